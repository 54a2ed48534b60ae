"""The compiled pipeline step: the jitted shard_map entry points of one program.

`PipelineStep` wraps a TickProgram (tick.py) in the public API: value_and_grad,
train_step on per-stage trees, device_train_step on the device layout
(layout/device_state.py), AOT compilation and memory analysis. How per-stage
trees, batches and tick rows cross the shard_map boundary is step_io.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as PS

from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.async_pipeline.async_carry import CarryingStep, InFlight
from pjit_pipe.lowering.comms.topology import AXES
from pjit_pipe.lowering.compute.branch_permutes import BranchSafeJit
from pjit_pipe.lowering.compute.compute_dtype import buffer_dtypes
from pjit_pipe.lowering.compute.rng import check_rngs, microbatch_key_data
from pjit_pipe.lowering.compute.tick import TickProgram
from pjit_pipe.lowering.layout.device_state import DeviceLayout
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec
from pjit_pipe.lowering.layout.optimizer import StageOptimizer
from pjit_pipe.lowering.layout.row_optimizer import RowOptimizer
from pjit_pipe.lowering.layout.tensor_layout import opt_state_splits
from pjit_pipe.lowering.layout.zero import ZeroLayout
from pjit_pipe.lowering.step_io import StepIO


class PipelineStep(StepIO):
    """A compiled pipeline for one schedule and one set of shapes (see `lower`)."""

    def __init__(
        self,
        schedule: Schedule,
        lowered: TickProgram,
        optimizer: optax.GradientTransformation | None,
        examples: tuple[Any, Any, Any],
        zero: int = 0,
        grad_sum: str = "accumulator",
    ):
        self.schedule = schedule
        self.optimizer = optimizer
        self.topology = lowered.topo
        self._low = lowered
        self._examples = examples
        topo = lowered.topo
        self._positions = topo.positions
        self._first_holder = np.array([topo.holders(p)[0] for p in range(schedule.stages)])
        self._opt_spec = None
        # A leafwise update (adam, sgd, ...) steps whole rows (row_optimizer.py).
        rows = (
            None if optimizer is None or zero else RowOptimizer.fit(optimizer, lowered.param_spec)
        )
        self._stepper = StageOptimizer(lowered, optimizer, rows) if optimizer is not None else None
        # ZeRO over 'data' (zero.py): the optax state in slices, one per replica
        # (zero=1), and the parameters between steps too (zero=3).
        self._zero = None
        if optimizer is not None and zero:
            self._zero = ZeroLayout(
                lowered.param_spec,
                schedule.replicas,
                optimizer,
                schedule.num_virtual_stages,
                lowered.held,
                lowered.shared,
                level=int(zero),
                gather_dtypes=buffer_dtypes(lowered.param_spec, lowered.st.compute_dtypes),
                reduce_in_compute=grad_sum == "slices-compute",
            )
            self._opt_spec = self._zero.opt_spec
        elif optimizer is not None and rows is not None:
            self._opt_spec = rows.spec
        elif optimizer is not None:
            avals = lowered.st.param_avals
            splits = lowered.splits
            self._opt_spec = FlatSpec(
                [jax.eval_shape(optimizer.init, a) for a in avals],
                splits=None
                if splits is None
                else [
                    opt_state_splits(optimizer, a, h) for a, h in zip(avals, splits, strict=True)
                ],
            )
        # ZeRO's grad_sum="slices" or "slices-compute": each W reduce-scatters its
        # gradient into the slices.
        self._grad_slices = self._zero if grad_sum != "accumulator" else None
        # Each entry point's first compile is checked for reshards inside a stage's
        # branch, which would deadlock (branch_permutes.py).
        self._vg = BranchSafeJit(jax.jit(self._value_and_grad))
        self._train = BranchSafeJit(jax.jit(self._train_step)) if optimizer is not None else None
        self._compiled_train = None
        # The training state between steps: each device's rows of its own stages.
        self.layout: DeviceLayout | None = None
        if optimizer is not None:
            self.layout = DeviceLayout(
                topo, lowered.held, lowered.param_spec, self._opt_spec, optimizer, self._zero
            )
        # The device-layout step per (donate, skip_nonfinite): consuming its state
        # buffers or not, keeping them where the step is not finite or not.
        self._device_steps = {
            (donate, skip): BranchSafeJit(
                jax.jit(
                    functools.partial(self._train_buffers, skip_nonfinite=skip),
                    donate_argnums=(0, 1) if donate else (),
                )
            )
            for donate in (True, False)
            for skip in (True, False)
        }
        self._compiled_device: dict[tuple[bool, bool], Any] = {}
        self._compiled_vg = None
        self._carrying: CarryingStep | None = None  # built by carry_train_step

    def _value_and_grad(self, stage_params, x, y):
        low = self._low

        def body(params, x, y, rows, pos):
            params, x, y, rows, pos = self._local(params, x, y, rows, pos)
            loss, grads = low.tick_loop(params, x, y, rows, pos, with_aux=low.loss.has_aux)
            return loss, {k: g[None] for k, g in grads.items()}

        f = self._shard_map(body, 1, (PS(), self.topology.spec))
        params = self._placed(low.param_spec, self._pack(low.param_spec, stage_params))
        loss, grads = f(params, *self._device_args(x, y, low.plan))
        return loss, self._unpack(low.param_spec, self._placed(low.param_spec, grads))

    def _train_buffers(self, params: Buffers, opt: Buffers, x, y, skip_nonfinite: bool = False):
        """The training step on the device layout: (params, opt) buffers of shape
        (devices, v, L) in, the updated buffers, the loss and whether the update was
        skipped out. With `skip_nonfinite` (not with the optimizer inside the loop)
        a step whose loss or global gradient norm is not finite returns the buffers
        it was given: the choice is made here, so donated buffers lose nothing."""
        low, spec = self._low, self._opt_spec
        rows_spec = low.param_spec if self._zero is None else self._zero.rows_spec
        plan = low.step_plan if low.stepping else low.plan
        if skip_nonfinite and low.stepping:
            raise ValueError(
                "skip_nonfinite: this program steps each stage's optimizer inside the tick "
                "loop, before the loss and the global gradient norm are known"
            )

        def body(params, opt, x, y, rows, pos, *updates):
            # This device's (1, v, L) blocks: the row step updates them in place (a row
            # cut out of them by rank would be copied first, row_optimizer.py).
            param_block, opt_block = params, opt
            params, opt, x, y, rows, pos = self._local(params, opt, x, y, rows, pos)
            skipped = jnp.zeros((), bool)
            if low.stepping:
                params, opt, loss = self._stepper.stepping_loop(
                    spec, params, opt, x, y, rows, *updates, pos
                )
            elif self._zero is not None:
                # ZeRO-3 holds slices: the loop reads the rows gathered once per step.
                whole = self._zero.gather(params) if self._zero.level == 3 else params
                loss, grads = low.tick_loop(
                    whole, x, y, rows, pos, reduce=self._zero.scatter, slices=self._grad_slices
                )
                new = self._zero.step(params, grads, opt, pos)
                if skip_nonfinite:  # grads are this replica's slices: any device's verdict
                    bad = sum(jnp.sum(~jnp.isfinite(g)) for g in grads.values())
                    bad = low.topo.psum(bad + jnp.sum(~jnp.isfinite(loss)), AXES)
                    skipped = bad > 0
                    new = jax.tree.map(lambda n, o: jnp.where(skipped, o, n), new, (params, opt))
                params, opt = new
            else:
                loss, grads = low.tick_loop(params, x, y, rows, pos)
                keep = self._stepper.finite(loss, grads) if skip_nonfinite else None
                if self._stepper.rows is not None:
                    grad_block = {k: g[None] for k, g in grads.items()}
                    new = self._stepper.rows.step(param_block, grad_block, opt_block, keep)
                    params, opt = ({k: b[0] for k, b in bufs.items()} for bufs in new)
                else:
                    params, opt = self._stepper.optimizer_step(spec, params, grads, opt, pos, keep)
                if keep is not None:
                    skipped = ~keep
            return (
                {k: b[None] for k, b in params.items()},
                {k: b[None] for k, b in opt.items()},
                loss,
                skipped,
            )

        out = self.topology.spec
        updates = (jnp.asarray(plan.updates),) if low.stepping else ()
        f = self._shard_map(body, 2, (out, out, PS(), PS()), n_replicated=len(updates))
        params, opt = self._placed(rows_spec, params), self._placed(spec, opt)
        params, opt, loss, skipped = f(params, opt, *self._device_args(x, y, plan), *updates)
        params, opt = self._placed(rows_spec, params), self._placed(spec, opt)
        if low.stepping and low.iterations == 1:
            loss = loss[0]
        return params, opt, loss, skipped

    @property
    def steps_in_loop(self) -> bool:
        """Whether the optimizer steps stages inside the tick loop (a staggered
        schedule, or iterations > 1), so no step can be skipped as a whole."""
        return self._low.stepping

    def _train_step(self, stage_params, opt_state, x, y):
        low, spec = self._low, self._opt_spec
        params, opt, loss, _ = self._train_buffers(
            self._pack(low.param_spec, stage_params), self._pack(spec, opt_state), x, y
        )
        return self._unpack(low.param_spec, params), self._unpack(spec, opt), loss

    # ---- public API ----

    def _with_keys(self, x: Any, rngs: Any) -> Any:
        """The batch with each microbatch's key data next to it, when lowered with rngs."""
        impls = self._low.rng_impls
        if (rngs is None) != (impls is None):
            raise ValueError(
                "rngs: this pipeline was lowered "
                + ("with rngs: pass rngs=" if impls else "without rngs: lower(..., rngs=) first, ")
                + f"a dict like {{'dropout': jax.random.key(0)}} (streams {sorted(impls or {})})"
            )
        if rngs is None:
            return x
        rngs = check_rngs(rngs)
        if sorted(rngs) != sorted(impls):
            raise ValueError(f"rngs: expected the streams {sorted(impls)}, got {sorted(rngs)}")
        count = self.schedule.replicas * self.schedule.microbatches
        return x, microbatch_key_data(rngs, count, self._low.iterations)

    def value_and_grad(
        self, stage_params: Sequence[Any], x: Any, y: Any, rngs: Any = None
    ) -> tuple[jax.Array, list]:
        """(loss over the global batch, per-stage parameter gradients); the loss is
        (loss, aux) when lowered with has_aux=True (see loss.py). `rngs`: when
        lowered with rngs, this step's {stream: key} (see rng.py)."""
        return self._vg(list(stage_params), self._with_keys(x, rngs), y)

    def init_opt_state(self, stage_params: Sequence[Any]) -> list[Any]:
        """One optax state per virtual stage (the optimizer runs stage by stage)."""
        if self.optimizer is None:
            raise ValueError("init_opt_state needs lower(..., optimizer=an optax transformation)")
        return [self.optimizer.init(p) for p in stage_params]

    def train_step(
        self,
        stage_params: Sequence[Any],
        opt_state: Sequence[Any],
        x: Any,
        y: Any,
        rngs: Any = None,
    ) -> tuple[list, list, jax.Array]:
        """(new stage params, new opt state, loss before the update).

        Compiled with iterations=N > 1, one call runs N steps: x and y carry a
        leading axis of N batches and the loss is one per step. Staggered
        schedules (and N > 1) step each stage's optimizer inside the loop, as
        soon as its gradients are complete; otherwise all stages step after it.
        """
        if self._train is None:
            raise ValueError("train_step needs lower(..., optimizer=an optax transformation)")
        if self._zero is not None:
            raise ValueError(
                "train_step on per-stage trees: with zero=True the optax state is in slices; "
                "use device_train_step on the device layout (Pipelined.train_step does)"
            )
        run = self._compiled_train or self._train
        return run(list(stage_params), list(opt_state), self._with_keys(x, rngs), y)

    def compile_train_step(
        self, stage_params: Sequence[Any], opt_state: Sequence[Any], x: Any, y: Any
    ) -> float:
        """AOT-compile train_step for arguments shaped and placed like these (arrays
        or ShapeDtypeStructs with shardings); later calls run that executable and
        must pass arguments placed the same way. Returns the seconds it took."""
        if self._train is None:
            raise ValueError("train_step needs lower(..., optimizer=an optax transformation)")
        if self._low.rng_impls is not None:
            raise ValueError(
                "compile_train_step: a pipeline lowered with rngs compiles on its first "
                "train_step call instead"
            )
        start = time.perf_counter()
        args = jax.tree.map(_abstract_placed, (list(stage_params), list(opt_state), x, y))
        self._compiled_train = self._train.check(self._train.lower(*args).compile())
        return time.perf_counter() - start

    def device_train_step(
        self,
        params: Buffers,
        opt: Buffers,
        x: Any,
        y: Any,
        donate: bool = True,
        rngs: Any = None,
        skip_nonfinite: bool = False,
    ) -> tuple[Buffers, Buffers, jax.Array, jax.Array]:
        """train_step on the device layout (`self.layout`): (params, opt) buffers in
        and out, no per-stage trees, then the loss and whether the update was
        skipped. With `donate` the buffers passed in are consumed (their memory
        holds the new state). With `skip_nonfinite` a step whose loss or global
        gradient norm is not finite leaves the state as it was (not where
        `steps_in_loop`). `rngs` as in `train_step`."""
        if self.layout is None:
            raise ValueError(
                "device_train_step needs lower(..., optimizer=an optax transformation)"
            )
        key = (donate, skip_nonfinite)
        run = self._compiled_device.get(key) or self._device_steps[key]
        return run(params, opt, self._with_keys(x, rngs), y)

    def compile_device_train_step(
        self, x: Any, y: Any, donate: bool = True, skip_nonfinite: bool = False
    ) -> float:
        """AOT-compile device_train_step for batches shaped and placed like x and y
        (arrays or ShapeDtypeStructs with shardings); returns the seconds it took."""
        if self.layout is None:
            raise ValueError(
                "device_train_step needs lower(..., optimizer=an optax transformation)"
            )
        if self._low.rng_impls is not None:
            raise ValueError(
                "compile_device_train_step: a pipeline lowered with rngs compiles on its "
                "first device_train_step call instead"
            )
        start = time.perf_counter()
        batch = jax.tree.map(_abstract_placed, (x, y))
        key = (donate, skip_nonfinite)
        lowered = self._device_steps[key].lower(*self.layout.avals(), *batch)
        self._compiled_device[key] = self._device_steps[key].check(lowered.compile())
        return time.perf_counter() - start

    def carry_train_step(
        self,
        params: Buffers,
        opt: Buffers,
        in_flight: InFlight | None,
        x: Any = None,
        y: Any = None,
        drain: bool = False,
        donate: bool = True,
    ) -> tuple[Buffers, Buffers, InFlight | None, jax.Array | None]:
        """device_train_step of an asynchronous schedule that carries the microbatches
        in flight from one call to the next (see async_carry.py): each call runs one
        steady-state window on this call's batch.

        Returns (params, opt, in flight, loss). Pass in_flight=None to start (the
        pipeline fills) and the returned one to the next call; `drain=True` (no
        batch) finishes every microbatch in flight and returns in_flight=None. The
        loss is the mean loss of the previous call's batch, whose microbatches all
        finished in this call: NaN for a first call, None for a drain with nothing
        in flight. N calls and a drain equal one call of iterations=N."""
        if self.layout is None:
            raise ValueError("carry_train_step needs lower(..., optimizer=an optax transformation)")
        if not drain and (x is None or y is None):
            raise ValueError("carry_train_step: pass this call's batch x and y (or drain=True)")
        if self._carrying is None:
            self._carrying = CarryingStep(self._low, self._stepper, self._opt_spec)
        return self._carrying(params, opt, in_flight, x, y, drain, donate)

    def async_weight_bytes(self) -> int:
        """Bytes each device holds for the extra weight copies of an asynchronous
        schedule (predict: the last update; stash: one version per residual slot);
        0 for a synchronous one."""
        low = self._low
        if low.weights is None:
            return 0
        return low.weights.extra_bytes(low.param_spec, (low.step_plan or low.plan).res_slots)

    def device_memory_analysis(
        self, donate: bool = True, skip_nonfinite: bool | None = None
    ) -> Any:
        """XLA's memory analysis of the compiled device_train_step (compiled by
        `compile_device_train_step` first) with this `donate`; `skip_nonfinite`
        None: whichever non-finite check it was compiled with (with the check
        when both were)."""
        checks = (True, False) if skip_nonfinite is None else (skip_nonfinite,)
        for skip in checks:
            if (donate, skip) in self._compiled_device:
                return self._compiled_device[donate, skip].memory_analysis()
        raise ValueError(
            f"device_memory_analysis: no device_train_step compiled with donate={donate}"
            + ("" if skip_nonfinite is None else f", skip_nonfinite={skip_nonfinite}")
            + "; call compile_device_train_step (TrainStep.compile) with them first"
        )

    def memory_analysis(self) -> Any:
        """XLA's memory analysis of the compiled value_and_grad program."""
        if self._compiled_vg is None:
            self._compiled_vg = self._vg.check(self._vg.lower(*self._examples).compile())
        return self._compiled_vg.memory_analysis()


def _abstract_placed(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=a.sharding)
