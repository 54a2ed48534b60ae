"""What one compiled program holds on each device, predicted from shapes alone.

The prediction builds the same layouts the lowering would (the parameters'
size classes or flat rows, the optax rows or ZeRO's slices, the residual
pools and the message store sized by the tick plan), but no mesh and no
array: a 70B model's `jax.eval_shape` avals and a D x P x T deployment larger
than the machine are enough. Per pipeline position it counts, in bytes of one
device:

- `params`, `optimizer`: the state between steps (what `TrainState.device_bytes`
  gives): each position's rows, padded to the largest stage as one SPMD
  program needs, split over 'tensor' where annotated, and with ZeRO the
  optax state in slices (a device's own and a copy of the next replica's),
  with ZeRO-3 the parameters too;
- `grads`: the gradient the step accumulates over the microbatches (one
  buffer like the parameter rows), plus with ZeRO the slice the
  reduce-scatter leaves; with `grad_sum="slices"` or `"slices-compute"` only
  slices (each W's gradient reduce-scattered as it is made, compute/tick.py);
- `update`: the optax update's working copy (the new state is written while
  the old one is read: as large as `optimizer`);
- `gathered`: parameters all-gathered over 'data' for the step (ZeRO-1: the
  updated rows, once per step; ZeRO-3: the stage's whole rows, before the
  tick loop);
- `activations`: the residual pools, as many rows as the tick plan keeps in
  flight on the busiest device times the widest stage's row (one program
  sizes every device's pools alike);
- `workspace`: the ops' live intermediates, in one microbatch's vjp residuals
  of the busiest position (`WORKSPACE_MICROBATCHES`, `WORKSPACE_REMAT_CHUNKS`:
  an estimate, as XLA decides what is live at once), and where the model remats
  its own layers one layer's recomputed residuals (`WORKSPACE_REGIONS`,
  compute/remat_regions.py); or a W's own gradient output where that is larger;
- `messages`: the message store's rows (boundary activations and their
  cotangents; with remat the stored stage inputs);
- `inputs`: the global batch each device receives (x and y, replicated).

ZeRO-3 (`zero=3`, layout/zero.py) holds the parameters in slices like ZeRO-1's
optax state (its own and the next replica's copy), gathers them whole once per
step before the tick loop, in their compute dtype (bf16 where the model reads
them through a cast to bf16), and sums the gradients as ZeRO-1 does (one
accumulator reduce-scattered once, or in slices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import optax

from pjit_pipe.errors import OptionError
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering.comms.messages import MessageSpec
from pjit_pipe.lowering.compute.compute_dtype import buffer_dtypes, compute_param_spec
from pjit_pipe.lowering.compute.stages import StageVjp
from pjit_pipe.lowering.layout.flat_buffers import FlatSpec
from pjit_pipe.lowering.layout.row_optimizer import RowOptimizer
from pjit_pipe.lowering.layout.tensor_layout import LeafSplits, opt_state_splits
from pjit_pipe.lowering.layout.zero import ZeroLayout
from pjit_pipe.lowering.layout_bytes import own_bytes, row_bytes, w_output_bytes
from pjit_pipe.lowering.tick_plan import build_plan

ZERO_LEVELS = (0, 1, 3)
# The ops' live intermediates, in one microbatch's vjp residuals: a position's
# stages' (the residuals a tick's forward makes before they are stored, and the
# cotangents its backward makes of them), or with remat one chunk's (a backward
# that recomputes holds the residuals and their cotangents beside the tick's
# forward). Fitted on CPU: totals within 0.91-1.05x of XLA's peak on the tiny GPT
# and MLP at ZeRO 0, 1 and 3, 0.88-1.11x with remat (benchmarks/bench_memory.py).
WORKSPACE_MICROBATCHES = 2
WORKSPACE_REMAT_CHUNKS = 3
# A model's own remat region (stages.region_bytes), recomputed one at a time: its
# residuals, and their cotangents while the residuals are consumed. Fitted on CPU on
# the tiny f32 Llama (nn.remat blocks): totals within 0.97-1.05x of XLA's peak at
# ZeRO 0 and 3, with and without the pipeline's remat.
WORKSPACE_REGIONS = 1.5
PARTS = (
    "params",
    "grads",
    "optimizer",
    "update",
    "gathered",
    "activations",
    "workspace",
    "messages",
    "inputs",
)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Predicted bytes on one device of pipeline position `stage` (module docstring).

    `own_state`: the parameters and optax state of the stages it runs, unpadded
    (sliced as its ZeRO level slices them): what `state` would be without the
    padding to the largest stage."""

    stage: int
    params: int
    grads: int
    optimizer: int
    update: int
    gathered: int
    activations: int
    workspace: int
    messages: int
    inputs: int
    own_state: int
    gathered_in_loop: bool = False

    @property
    def state(self) -> int:
        """Bytes held between steps: parameters and optax state."""
        return self.params + self.optimizer

    @property
    def total(self) -> int:
        """Bytes the device needs at the step's peak: the state, the batch and the
        gradient throughout, and the larger of the tick loop's parts (residual pools,
        workspace, messages) and the update's (its working copy, the gathered rows
        of ZeRO-1); ZeRO-3's gathered rows live through the loop."""
        loop = self.activations + self.workspace + self.messages
        after = self.update
        if self.gathered_in_loop:
            loop += self.gathered
        else:
            after += self.gathered
        return self.state + self.inputs + self.grads + max(loop, after)

    def as_dict(self) -> dict[str, int]:
        """The parts, the state and the total, by name."""
        return {
            "stage": self.stage,
            **{part: getattr(self, part) for part in PARTS},
            "state": self.state,
            "own_state": self.own_state,
            "total": self.total,
        }


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The prediction for one deployment: D x P x T devices at one ZeRO level.

    `devices[p]` is what each device of pipeline position p holds. `compiled`:
    XLA's memory analysis of the compiled step where it was compiled (bytes of
    one device's program: its arguments, temporaries, and its peak, the
    arguments and temporaries with the outputs that do not reuse an argument).
    """

    data: int
    stages: int
    tensor: int
    zero: int
    devices: tuple[DeviceMemory, ...]
    compiled: dict[str, int] | None = None

    def largest(self) -> DeviceMemory:
        """The device with the largest total."""
        return max(self.devices, key=lambda d: d.total)

    def fits(self, device_memory: int) -> bool:
        """Whether every device's total is at most `device_memory` bytes."""
        return self.largest().total <= device_memory

    def with_compiled(self, analysis: Any) -> MemoryReport:
        """This report with XLA's figures from a compiled step's `memory_analysis()`."""
        arguments = int(analysis.argument_size_in_bytes)
        temporaries = int(analysis.temp_size_in_bytes)
        fresh = int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes)
        compiled = {
            "compiled_arguments": arguments,
            "compiled_temporaries": temporaries,
            "compiled_peak": arguments + temporaries + fresh,
        }
        return dataclasses.replace(self, compiled=compiled)

    def as_dict(self, device_memory: int | None = None) -> dict[str, Any]:
        """The report as JSON-ready values; `fits` when `device_memory` is given."""
        largest = self.largest()
        out: dict[str, Any] = {
            "mesh": [self.data, self.stages, self.tensor],
            "zero": self.zero,
            "devices": [d.as_dict() for d in self.devices],
            **{part: getattr(largest, part) for part in PARTS},
            "state": largest.state,
            "total": largest.total,
            "mean_own_state": round(sum(d.own_state for d in self.devices) / len(self.devices)),
        }
        if device_memory is not None:
            out["device_memory"] = device_memory
            out["fits"] = self.fits(device_memory)
        if self.compiled is not None:
            out.update(self.compiled)
        return out


def optimizer_spec(
    param_spec: FlatSpec,
    param_avals: Sequence[Any],
    splits: Sequence[LeafSplits] | None,
    optimizer: optax.GradientTransformation,
    zero: ZeroLayout | None,
) -> FlatSpec:
    """The optax rows' layout the lowering keeps (PipelineStep): ZeRO's slices,
    the row optimizer's rows for a leafwise update, else each stage's own state."""
    if zero is not None:
        return zero.opt_spec
    rows = RowOptimizer.fit(optimizer, param_spec)
    if rows is not None:
        return rows.spec
    return FlatSpec(
        [jax.eval_shape(optimizer.init, a) for a in param_avals],
        splits=None
        if splits is None
        else [opt_state_splits(optimizer, a, h) for a, h in zip(param_avals, splits, strict=True)],
    )


def predict_memory(
    table: PackedTicks,
    stages: StageVjp,
    optimizer: optax.GradientTransformation,
    *,
    zero: int = 0,
    tensor: int = 1,
    splits: Sequence[LeafSplits] | None = None,
    remat: bool = False,
    input_bytes: int = 0,
    grad_sum: str = "accumulator",
) -> MemoryReport:
    """Per pipeline position, the bytes one of its devices holds (module docstring).

    Args:
        table: the tick table the program would run (its schedule gives D, P, v).
        stages: the traced stages (`traced_stages`): parameter avals, residual pools
            and boundaries.
        optimizer: the optax transformation of the train step.
        zero: 0 (optax state whole on every replica), 1 (optax state in slices over
            'data') or 3 (parameters and optax state in slices).
        tensor: T, the devices each worker's weights split over where annotated.
        splits: per virtual stage, per parameter leaf, its split over 'tensor'.
        remat: the backward recomputes each stage's forward (no residual pools).
        input_bytes: bytes of the global batch (x and y), which every device receives.
        grad_sum: with zero, "accumulator" (one whole gradient accumulator and the
            slice its reduce-scatter leaves), "slices" (the slices alone) or
            "slices-compute" (those, each W's reduce-scatter in its compute dtype).

    Returns:
        The MemoryReport: one DeviceMemory per pipeline position (its replicas
        hold the same).

    Raises:
        OptionError: `zero` is not 0, 1 or 3.
    """
    if zero not in ZERO_LEVELS:
        raise OptionError(f"zero: expected one of 0, 1, 3, got {zero!r}")
    schedule = table.schedule
    D = schedule.replicas
    sliced = zero and D > 1  # one replica has nothing to shard over
    held = [schedule.held_stages(p) for p in range(schedule.stages)]
    v = len(held[0])
    param_spec = compute_param_spec(
        stages.param_avals, splits, D if sliced else 1, stages.compute_dtypes
    )
    gather_dtypes = buffer_dtypes(param_spec, stages.compute_dtypes)
    zero_layout = (
        ZeroLayout(
            param_spec,
            D,
            optimizer,
            schedule.num_virtual_stages,
            held,
            None,
            level=zero,
            gather_dtypes=gather_dtypes,
            reduce_in_compute=grad_sum == "slices-compute",
        )
        if sliced
        else None
    )
    opt_spec = optimizer_spec(param_spec, stages.param_avals, splits, optimizer, zero_layout)
    rows = v * row_bytes(param_spec, tensor)
    opt = v * row_bytes(opt_spec, tensor)
    params, gathered, scattered = rows, 0, 0
    if sliced:
        scattered = rows // D
        gathered = rows  # ZeRO-1: the updated rows, all-gathered after the update
        if zero == 3:
            params = 2 * scattered  # its own slice and a copy of the next replica's
            # The stage's whole rows in their compute dtype, gathered before the tick loop.
            gathered = v * row_bytes(param_spec, tensor, zero_layout.gather_dtypes)
    plan = build_plan(
        table,
        remat,
        schedule.alive_workers,
        split=stages.split,
        fuse_loss=not schedule.asynchronous,
    )
    w_row, b_row = row_bytes(stages.w_spec, 1), row_bytes(stages.b_spec, 1)
    pools = 0 if remat else plan.res_slots * w_row + plan.bres_slots * b_row
    # One program: every device's workspace is sized by the busiest position's.
    residuals = [stages.residual_bytes(s)["b"] for s in range(schedule.num_virtual_stages)]
    if remat:
        workspace = WORKSPACE_REMAT_CHUNKS * max(residuals)
    else:
        workspace = WORKSPACE_MICROBATCHES * max(sum(residuals[s] for s in h) for h in held)
    # A model's own checkpointed regions (nn.remat blocks): their stage stores only their
    # inputs, and the backward recomputes one region's residuals at a time.
    region = max(stages.region_bytes(s) for s in range(schedule.num_virtual_stages))
    workspace += round(WORKSPACE_REGIONS * region)
    messages = plan.store_rows * _message_row_bytes(stages)
    # The gradient the step carries: one accumulator of the rows (and with ZeRO the
    # slice its reduce-scatter leaves), or with grad_sum="slices" the slices and one
    # W's reduce-scattered slice beside them.
    slices = sliced and grad_sum != "accumulator"
    grads = 2 * scattered if slices else rows + scattered
    # A W's own output, live while its cond runs (the ops' conds share temporaries).
    reduce = zero_layout.reduce_dtypes if slices else None
    w_output = w_output_bytes(param_spec, tensor, gather_dtypes, reduce, D)
    workspace = max(workspace, w_output)
    own = [
        own_bytes(a, None if splits is None else splits[s], optimizer, tensor)
        for s, a in enumerate(stages.param_avals)
    ]
    share = {0: (1, 1), 1: (1, 2 / D), 3: (2 / D, 2 / D)}[zero if sliced else 0]
    devices = [
        DeviceMemory(
            stage=p,
            params=params,
            grads=grads,
            optimizer=opt,
            update=opt,
            gathered=gathered,
            activations=pools,
            workspace=workspace,
            messages=messages,
            inputs=input_bytes,
            gathered_in_loop=zero == 3,
            own_state=round(sum(share[0] * own[s][0] + share[1] * own[s][1] for s in held[p])),
        )
        for p in range(schedule.stages)
    ]
    return MemoryReport(D, schedule.stages, tensor, zero, tuple(devices))


def _message_row_bytes(stages: StageVjp) -> int:
    """Bytes of one message-store row: the widest boundary activation or
    cotangent between two stages, per dtype (comms/messages.py's flat rows)."""
    spec = MessageSpec(stages.act_avals[1:]).spec
    return sum(spec.nbytes(k) for k in spec.sizes)
