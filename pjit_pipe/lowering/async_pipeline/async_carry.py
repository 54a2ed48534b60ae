"""Asynchronous 1F1B across compiled calls: one steady-state window per call.

Run with `iterations=N`, an asynchronous program never flushes inside the call,
but every call still starts empty and ends drained. The carrying program
instead runs, per call, one period of the pipeline's steady state, and hands
the microbatches still in flight at its end to the next call.

**The window.** The one-op-per-tick table of the overlapping stream
(`PackedTicks.one_op_per_tick`) is periodic after its first iteration: the
ticks from the first op of iteration k to the first op of iteration k+1 are
the same for every k >= 1, with the iterations renumbered. That span of
`period` ticks is the window (steady_window.py plans it). It holds ops of two
iterations: the tail of the previous batch (its last backwards, and the last
stage's forwards and losses of its later microbatches) and the head of this
call's batch. Each call brings one batch and runs the window once.

**What is carried** (`InFlight`, per device): the message store (activations
and gradients sent and not yet read), the residual store (each in-flight
microbatch's saved forward values, and with `stash` its weight version), the
weight policy's buffers (`predict`: the last update u), this device's partial
loss of the batch in flight, and the input rows of that batch that the next
window still reads (the last stage's labels). Slots are planned over a table
of several iterations, so a tensor that crosses the window's end sits in
another slot than the one the next call reads it from: a fixed permutation
of slots at the end of each call moves it there. Gradient accumulators are
not carried: every W/BW of an asynchronous schedule steps its stage in the
same window (steady_window checks it), so they are zero at every boundary.

**Fill and drain.** A runtime flag per iteration of the window masks its
ops: the first call (nothing in flight) runs the window without the previous
batch's ops (the pipeline fills), and a drain call (`drain=True`) runs it
without a new batch's ops, which finishes every microbatch in flight. All
three are one compiled program, and each takes the window's ticks (a masked
op idles). Each worker runs its ops in the same order as
in one call of `iterations=N` (`engine.stream_order`), and the numbers an op
computes depend only on that order, so N calls and a drain give the same
parameters as one call of N iterations (tests/test_async_carry.py).

**The loss a call returns** is the mean loss of the batch whose last
microbatch finished in it: the previous call's batch (NaN for the first call,
which finishes none); the drain returns the last batch's loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from pjit_pipe.errors import OptionError
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.lowering.async_pipeline.steady_window import CURRENT, PREVIOUS, steady_window
from pjit_pipe.lowering.compute.stages import Residuals
from pjit_pipe.lowering.compute.tick import TickProgram
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec
from pjit_pipe.lowering.layout.optimizer import StageOptimizer
from pjit_pipe.lowering.shard_map_operands import shard_map_without_empty_operands
from pjit_pipe.lowering.tick_plan import TickRow


def check_carry(schedule: Schedule, rngs: bool) -> None:
    """Raise OptionError when `schedule` cannot carry microbatches across calls."""
    if not schedule.asynchronous:
        raise OptionError(
            f"carrying microbatches across calls needs an asynchronous schedule "
            f"(async-1f1b), not {schedule.kind!r}: a synchronous one flushes every "
            "iteration; drop carry or use schedule async-1f1b"
        )
    if schedule.failed:
        raise OptionError(
            "carrying microbatches across calls with failed workers is not supported yet; "
            "train the fault-free pipeline"
        )
    if rngs:
        raise OptionError(
            "carrying microbatches across calls with per-microbatch rngs (dropout) is not "
            "supported yet; make the model deterministic or use iterations=N calls"
        )


InFlight = dict[str, Any]  # see `CarryingStep.empty`


class CarryingStep:
    """The carrying program of one lowered pipeline (the module docstring): a call
    runs one steady-state window on the device layout and returns the state
    in flight at its end. Built by `PipelineStep.carry_train_step` on first use."""

    def __init__(self, low: TickProgram, stepper: StageOptimizer, opt_spec: FlatSpec):
        check_carry(low.sched, low.rng_impls is not None)
        self.low, self.stepper, self.opt_spec = low, stepper, opt_spec
        self.window = steady_window(low.sched, low.remat, low.topo.workers)
        if self.window.plan.branches != low.plan.branches:
            raise ScheduleError("the steady window runs other ops than one iteration")
        self._runs = {
            donate: jax.jit(self._run, donate_argnums=(0, 1, 2) if donate else ())
            for donate in (True, False)
        }
        self._batch_like: Any = None  # the last call's (x, y): shapes and placement

    def empty(self, x: Any, y: Any) -> InFlight:
        """Nothing in flight, on the devices; per device (leading axis), the carried buffers:
        msgs: per dtype (K + 1, message size), messages sent and not read (K is scratch);
        res: Residuals of per-dtype (slots, size) stores, the in-flight microbatches'
            residuals (all in the W-pool: a fused BW frees them);
        weights: the weight policy's buffers (predict: u, (v, L); stash: (R + 1, v, L));
        loss: (loss vector size,), this device's partial loss of the batch in flight;
        x, y: (Lc, microbatch rows, ...), that batch's rows the next window reads."""
        low, plan = self.low, self.window.plan
        n, v = len(low.topo.workers), low.sched.chunks
        msgs, res, _ = low.empty(plan)
        weights = low.weights.init(low.param_spec.zeros(v), plan.res_slots)
        count = low.sched.replicas * low.sched.microbatches
        carried_n = self.window.carried.shape[1]

        def rows(a: jax.Array) -> jax.Array:
            return jnp.zeros((carried_n, a.shape[0] // count, *a.shape[1:]), a.dtype)

        one = {
            "msgs": msgs,
            "res": res,
            "weights": weights,
            "loss": low.ops.no_loss(),
            "x": jax.tree.map(rows, x),
            "y": jax.tree.map(rows, y),
        }
        sharding = NamedSharding(low.topo.mesh, low.topo.spec)
        return jax.tree.map(
            lambda a: jax.device_put(np.broadcast_to(np.asarray(a), (n, *a.shape)), sharding),
            one,
        )

    def __call__(
        self,
        params: Buffers,
        opt: Buffers,
        in_flight: InFlight | None,
        x: Any,
        y: Any,
        drain: bool,
        donate: bool,
    ) -> tuple[Buffers, Buffers, InFlight | None, jax.Array | None]:
        """(params, opt, in flight, loss of the batch that finished); see
        `PipelineStep.carry_train_step`."""
        if drain:
            if in_flight is None:  # nothing to finish
                return params, opt, None, None
            x, y = jax.tree.map(
                lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), self._batch_like
            )
        else:  # replicated on the program's devices (a no-op when it is)
            x, y = jax.device_put((x, y), NamedSharding(self.low.topo.mesh, PS()))
            self._batch_like = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=a.sharding), (x, y)
            )
        live = jnp.asarray([in_flight is not None, not drain])
        if in_flight is None:
            in_flight = self.empty(x, y)
        params, opt, in_flight, loss = self._runs[donate](params, opt, in_flight, x, y, live)
        return params, opt, (None if drain else in_flight), loss

    def _run(self, params: Buffers, opt: Buffers, flight: InFlight, x: Any, y: Any, live):
        low, win = self.low, self.window
        D, m = low.sched.replicas, low.sched.microbatches

        def rows_of(a, which):  # the global batch's rows `which` (devices, L, 2) picks
            a = a.reshape(D, m, a.shape[0] // (D * m), *a.shape[1:])
            return a[which[..., 0], which[..., 1]]

        batch = [
            jax.tree.map(lambda c, a: jnp.concatenate([c, rows_of(a, win.fresh)], 1), kept, new)
            for kept, new in ((flight["x"], x), (flight["y"], y))
        ]
        keep = [jax.tree.map(lambda a: rows_of(a, win.carried), t) for t in (x, y)]
        stash = low.weights.mode == "stash"
        count = D * m

        def body(*args):
            *local, live, ups = args
            params, opt, msgs, res, weights, loss, x, y, rows, pos, opt_it, mm, rm = (
                jax.tree.map(lambda a: a[0], t) for t in local
            )
            rows = _mask(rows, live, opt_it)
            flight = (msgs, res, weights, jnp.stack([loss, jnp.zeros_like(loss)]))
            params, opt, (msgs, res, weights, losses) = self.stepper.stepping_loop(
                self.opt_spec, params, opt, x, y, rows, ups, pos, win.plan, flight
            )
            # Only the W-pool holds in-flight rows: async-1f1b runs fused BWs, so its
            # B-pool is empty (steady_window checks).
            msgs, res = _move(msgs, mm), Residuals(res.b, _move(res.w, rm))
            if stash:  # each version sits in its microbatch's residual slot
                weights = _move(weights, rm)
            done = low.loss.loss(low.topo.psum(losses[PREVIOUS], low.topo.axes), count)
            done = jnp.where(live[PREVIOUS], done, jnp.nan)
            out = (params, opt, msgs, res, weights, losses[CURRENT])
            return (*(jax.tree.map(lambda a: a[None], t) for t in out), done)

        spec = low.topo.spec
        f = shard_map_without_empty_operands(
            body,
            mesh=low.topo.mesh,
            in_specs=(spec,) * 13 + (PS(), PS()),
            out_specs=(spec,) * 6 + (PS(),),
            check_vma=False,
        )
        params, opt, msgs, res, weights, loss, done = f(
            params,
            opt,
            flight["msgs"],
            flight["res"],
            flight["weights"],
            flight["loss"],
            *batch,
            jax.tree.map(jnp.asarray, win.plan.rows),
            jnp.asarray(low.topo.positions),
            jnp.asarray(win.opt_iteration),
            jnp.asarray(win.msg_moves),
            jnp.asarray(win.res_moves),
            live,
            jnp.asarray(win.plan.updates),
        )
        flight = {"msgs": msgs, "res": res, "weights": weights, "loss": loss}
        flight["x"], flight["y"] = keep
        return params, opt, flight, done


def _mask(rows: TickRow, live: jax.Array, opt_iteration: jax.Array) -> TickRow:
    """The window's rows without the ops (and steps) of iterations that are not `live`."""
    lanes = {
        name: lane._replace(branch=jnp.where(live[lane.iteration], lane.branch, 0))
        for name, lane in (("f", rows.f), ("b", rows.b), ("w", rows.w), ("w2", rows.w2))
    }
    return rows._replace(**lanes, update=jnp.where(live[opt_iteration], rows.update, 0))


def _move(store: Buffers, moves: jax.Array) -> Buffers:
    """Slot moves[i, 0] -> slot moves[i, 1], all at once (a scratch index past the
    end of a store is clamped on read and dropped on write)."""
    return {k: b.at[moves[:, 1]].set(b[moves[:, 0]]) for k, b in store.items()}
