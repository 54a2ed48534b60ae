"""Tick table -> one jitted shard_map program: the public entry point `lower`.

The program is built in layers, one module each:
- plan.py: the schedule's tick table as per-device rows (`TickRow`) and buffer slots;
- tick_ops.py: the compute of each (op kind, virtual stage) the plan uses;
- tick.py: the tick body and the tick loop (`TickProgram`), with its carried buffers;
- optimizer.py: each stage's optax step, after the loop or inside it;
- step.py: the compiled entry points (`PipelineStep`).

A schedule with failed workers compiles the same way over the survivors only
(see topology.py); it is the same step, on the same global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from pjit_pipe.errors import BatchError, CutError, MeshError, OptimizerError, OptionError
from pjit_pipe.ir.memory import split_stages
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.ir.validate import validate
from pjit_pipe.lowering.async_pipeline.async_weights import async_weights_for
from pjit_pipe.lowering.comms.topology import AXES, TENSOR, Topology
from pjit_pipe.lowering.compute.emulated_ticks import EmulationHost
from pjit_pipe.lowering.compute.rng import check_rngs, impls_of, microbatch_rngs
from pjit_pipe.lowering.compute.stage_cache import traced_stages
from pjit_pipe.lowering.compute.tick import TickProgram
from pjit_pipe.lowering.layout.global_norm import count_norm_calls
from pjit_pipe.lowering.layout.optimizer import stage0_avals
from pjit_pipe.lowering.layout.shared import check_shared
from pjit_pipe.lowering.layout.tensor_layout import LeafSplits, any_split
from pjit_pipe.lowering.step import PipelineStep

__all__ = ["LoweringOptions", "PipelineStep", "TickProgram", "lower"]


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def _check_tensor(topology: Topology, splits, weights_kind: str) -> None:
    """Refuse, by name, what tensor parallelism does not support yet."""
    if not any_split(splits):
        return
    if topology.tensor == 1:
        raise MeshError("splits: leaves split over 'tensor' need a mesh with tensor > 1")
    if weights_kind == "async-1f1b":
        raise OptionError(
            "schedule='async-1f1b' with weights split over 'tensor' is not supported: its "
            "weight policies keep flat weight rows; use a synchronous schedule or tensor=1"
        )


def _check_zero(program: TickProgram, level: int) -> None:
    """Refuse, by name, the programs whose optimizer runs inside the tick loop:
    ZeRO reduce-scatters the gradients and all-gathers the parameters once per
    step, after the loop."""
    why = None
    if not program.topo.complete:
        why = (
            "failed workers: the survivors' mesh has no 'data' axis to reduce-scatter "
            "over; lower it with zero=False on the joined state (pjit_pipe.pipeline and "
            "ResilientTrainer do so, reading lost slices from their neighbours' copies)"
        )
    elif program.weights is not None:
        why = "schedule 'async-1f1b' (stale weights); use a synchronous schedule or zero=False"
    elif program.stepping:
        why = (
            "the optimizer inside the tick loop (a staggered schedule, or iterations > 1); "
            "use an unstaggered table with iterations=1, or zero=False"
        )
    if why:
        raise OptionError(f"{'zero=True' if level == 1 else f'zero={level}'} with {why}")


def _check(schedule: Schedule, stage_fns, mesh: Mesh, stage_params, x, y) -> None:
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"schedule must be a pjit_pipe Schedule, got {type(schedule).__name__}")
    validate(schedule)
    if tuple(mesh.axis_names) not in (AXES, (*AXES, TENSOR)):
        raise MeshError(
            f"mesh axes must be {(*AXES, TENSOR)} (pjit_pipe.make_mesh builds one), "
            f"got {tuple(mesh.axis_names)}"
        )
    shape = (mesh.shape["data"], mesh.shape["stage"])
    if shape != (schedule.replicas, schedule.stages):
        raise MeshError(
            f"mesh (data, stage) = {shape} does not match the schedule's "
            f"(replicas, stages) = {(schedule.replicas, schedule.stages)}"
        )
    S = schedule.num_virtual_stages
    if len(stage_fns) != S or len(stage_params) != S:
        raise CutError(
            f"stage_fns and stage_params need one entry per virtual stage (stages*chunks = {S}), "
            f"got {len(stage_fns)} and {len(stage_params)}"
        )
    lead = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves((x, y))}
    n = schedule.replicas * schedule.microbatches
    if len(lead) != 1 or None in lead:
        raise BatchError(f"x and y leaves must share one leading batch dimension, got {lead}")
    (batch,) = lead
    if batch % n:
        raise BatchError(f"global batch {batch} is not divisible by replicas*microbatches = {n}")


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
    """How `lower` compiles a tick table: everything beside the table and the model.

    optimizer: the optax transformation of `train_step` (None: value_and_grad only).
    remat: B and W recompute the stage forward instead of reading stored vjp residuals
        (the split backward is then off: both recompute).
    has_aux: loss_fn returns (loss, aux), aux a pytree of metrics averaged over
        microbatches (see compute/loss.py).
    rngs: an example {stream name: key} for stage functions that draw random numbers
        (dropout); each step then takes its own rngs, and a stage function reads its
        microbatch's keys with `current_rngs()` (see compute/rng.py).
    shared: a key of the stage parameter dicts -> the virtual stages that each hold a
        copy of it (tied weights): their gradients are summed, so the copies stay equal.
    split_backward: False makes W re-run the whole stage pullback (for comparisons).
    async_weights: for async-1f1b, "predict" (default), "stash" or "latest", and
    staleness_offset: see async_pipeline/async_weights.py.
    pairwise: send each message pair by its own ppermute, each tick only its own
        (tick_plan.build_plan): one controller per device then waits only for the
        devices it exchanges with (the neighbour-synchronous price).
    emulate: an `EmulationHost` that replaces every op's compute by a host
        callback sleeping its price: an emulated run of the same program.
    splits: per virtual stage, per parameter leaf, how it splits over the mesh's
        'tensor' axis (a per-dimension tuple of 'tensor' / None) or None
        (replicated); see layout/tensor_layout.py and docs/tensor_parallel.md.
    zero: 1 (or True): the optimizer state sharded over 'data'; 3: the parameters
        between steps too, gathered once per step (ZeRO, layout/zero.py); 0: off.
    grad_sum: with zero, "accumulator" (one whole accumulator, reduce-scattered
        after the tick loop), "slices" (each W's gradient reduce-scattered into
        the slices as it is made; compute/tick.py) or "slices-compute" (the same,
        reduce-scattered in the gradient's compute dtype).
    policies: per virtual stage, the residual policy its F stores under
        (compute/residual_policy.py); None: the default policy for every stage.
    """

    optimizer: optax.GradientTransformation | None = None
    remat: bool = False
    has_aux: bool = False
    rngs: Any = None
    shared: Mapping[str, Sequence[int]] | None = None
    split_backward: bool = True
    async_weights: str | None = None
    staleness_offset: int = 0
    pairwise: bool = False
    emulate: EmulationHost | None = None
    splits: Sequence[LeafSplits] | None = None
    zero: int = 0
    grad_sum: str = "accumulator"
    policies: Sequence[str] | None = None


def lower(
    table: PackedTicks | Schedule,
    stage_fns: Sequence[Callable],
    loss_fn: Callable,
    mesh: Mesh,
    stage_params: Sequence[Any],
    x: Any,
    y: Any,
    options: LoweringOptions | None = None,
) -> PipelineStep:
    """Compile a tick table for these stages into one SPMD program per entry point.

    Args:
        table: the tick table to run (`pjit_pipe.tick_packing.pack_ticks`), for its
            `iterations` back-to-back iterations; a bare Schedule runs its unpacked
            table (`PackedTicks.one_op_per_tick`: one op per device per tick).
        stage_fns: stage_fns[s](params_s, act) -> act for each of the P*v virtual stages.
        loss_fn: loss_fn(out, y_mb) -> the mean loss of one microbatch, or (loss_sum,
            weight) (masked/weighted losses: the loss is sum(loss_sum) / sum(weight)
            over the global batch); with options.has_aux, (either of those, aux).
        mesh: the whole (data, stage) mesh; with failed workers the program runs on
            the survivors' devices only (comms/topology.py).
        stage_params, x, y: examples (shapes only) of the stage parameters and the
            global batch of one iteration.
        options: how to compile (`LoweringOptions`; default: value_and_grad only).

    Returns:
        The compiled `PipelineStep`. An asynchronous table's train_step runs
        iterations*m optimizer steps, one per microbatch.

    Raises:
        ScheduleError, MeshError, CutError, BatchError, OptionError, OptimizerError:
            naming the argument that does not fit and the fix.
    """
    o = LoweringOptions() if options is None else options
    if isinstance(table, Schedule):
        table = PackedTicks.one_op_per_tick(table)
    if not isinstance(table, PackedTicks):
        raise OptionError(
            f"table must be a PackedTicks (pack_ticks) or a Schedule, got {type(table).__name__}"
        )
    schedule, iterations = table.schedule, table.iterations
    optimizer, remat, has_aux, rngs, shared = o.optimizer, o.remat, o.has_aux, o.rngs, o.shared
    splits, zero = o.splits, o.zero
    _check(schedule, stage_fns, mesh, stage_params, x, y)
    check_shared(shared or {}, stage_params)
    n = schedule.replicas * schedule.microbatches
    mb = lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // n, *np.shape(a)[1:]), jnp.result_type(a))  # noqa: E731
    # Stages run as separate B and W get the split backward (see the docstring).
    split = set(split_stages(schedule))
    if remat or not o.split_backward:
        split = set()
    impls, example_keys = None, {}
    if rngs is not None:
        typed = check_rngs(rngs)
        impls, example_keys = impls_of(typed), {k: jax.random.key_data(v) for k, v in typed.items()}
    # The failure variants of a pipeline share its traced stages (stage_cache.py).
    with microbatch_rngs(example_keys, impls) if impls else contextlib.nullcontext():
        loss, stages = traced_stages(
            stage_fns,
            loss_fn,
            has_aux,
            _abstract(list(stage_params)),
            jax.tree.map(mb, x),
            jax.tree.map(mb, y),
            split,
            o.policies,
            tensor_split=any_split(splits),
            rng_impls=impls,
        )
    topology = Topology.of(mesh, schedule.failed)
    _check_tensor(topology, splits, weights_kind=schedule.kind)
    table.check()
    weights = async_weights_for(
        schedule, o.async_weights, optimizer, stages.param_avals, remat, loss, o.staleness_offset
    )
    program = TickProgram(
        schedule,
        stages,
        topology,
        remat,
        iterations,
        shared,
        loss=loss,
        rng_impls=impls,
        ticks=table,
        weights=weights,
        emulate=o.emulate,
        pairwise=o.pairwise,
        splits=splits if any_split(splits) else None,
        row_multiple=schedule.replicas if zero else 1,
    )
    if zero:
        _check_zero(program, int(zero))
    stepping = optimizer is not None and program.stepping
    if stepping and count_norm_calls(optimizer, *stage0_avals(program, optimizer)):
        raise OptimizerError(
            "optimizer: it takes a norm of the whole update tree (optax.clip_by_global_norm "
            "or another optax.tree.norm / optax.global_norm user), which needs every "
            "stage's gradients before any stage steps; a staggered schedule or "
            "iterations > 1 steps stages at different times. Use an unstaggered "
            "table with iterations=1 (a re-routed one: schedule.replace(staggered=False)), "
            "or a per-parameter clip (optax.clip)"
        )
    if stepping and shared:
        raise OptionError(
            f"shared (tied) parameters {sorted(shared)} with the optimizer inside the tick "
            "loop (a staggered or re-routed table, iterations > 1): every holder's "
            "gradient is needed before the update; use an unstaggered table with "
            "iterations=1 (a re-routed one: schedule.replace(staggered=False)), or untie them"
        )
    examples = (_abstract(list(stage_params)), _abstract(x), _abstract(y))
    grad_sum = o.grad_sum if zero else "accumulator"
    if grad_sum != "accumulator" and shared:
        raise OptionError(
            f"grad_sum={grad_sum!r} with tied parameters {sorted(shared)}: their copies' "
            "gradients are summed over the stages that hold them before the reduce-scatter, "
            "which one W alone cannot do; use grad_sum='accumulator'"
        )
    return PipelineStep(schedule, program, optimizer, examples, zero=zero, grad_sum=grad_sum)
