"""Asynchronous 1F1B across compiled calls: one steady-state window per call.

Run with `iterations=N`, an asynchronous program never flushes inside the call,
but every call still starts empty and ends drained. The carrying program
instead runs, per call, one period of the pipeline's steady state, and hands
the microbatches still in flight at its end to the next call.

**The window.** The one-op-per-tick table of the overlapping stream
(`PackedTicks.one_op_per_tick`) is periodic after its first iteration: the
ticks from the first op of iteration k to the first op of iteration k+1 are
the same for every k >= 1, with the iterations renumbered. That span of
`period` ticks is the window (`SteadyWindow`). It holds ops of two
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
same window (checked here), so they are zero at every boundary.

**Fill and drain.** A runtime flag per iteration of the window masks its
ops: the first call (nothing in flight) runs the window without the previous
batch's ops (the pipeline fills), and a drain call (`drain=True`) runs it
without a new batch's ops, which finishes every microbatch in flight. All
three are one compiled program. Each worker runs its ops in the same order as
in one call of `iterations=N` (`engine.stream_order`), and the numbers an op
computes depend only on that order, so N calls and a drain give the same
parameters as one call of N iterations (tests/test_async_carry.py).

**The loss a call returns** is the mean loss of the batch whose last
microbatch finished in it: the previous call's batch (NaN for the first call,
which finishes none); the drain returns the last batch's loss.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from pjit_pipe.errors import OptionError
from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering.optimizer import StageOptimizer
from pjit_pipe.lowering.packing import Buffers, FlatSpec
from pjit_pipe.lowering.plan import LANE_OF, TickPlan, TickRow, build_plan
from pjit_pipe.lowering.tick import TickProgram

# Iterations of the table the window is cut from: enough for two periodic windows
# after the first one (the table's first and last iterations fill and drain).
TABLE_ITERATIONS = 5
PREVIOUS, CURRENT = 0, 1  # a window op's iteration: the previous call's batch, or this call's


@dataclass(frozen=True)
class SteadyWindow:
    """The host-side plan of one steady-state call (module docstring).

    plan: the window's tick rows, cut from a plan of a longer table (its slot
        sizes, shifts and branches); `OpRow.iteration` is PREVIOUS or CURRENT,
        and `OpRow.mb` indexes the device's rows of [carried, fresh] inputs.
    opt_iteration: int32 (devices, ticks), the iteration of the optimizer step
        after each tick (PREVIOUS or CURRENT; CURRENT where there is none).
    msg_moves / res_moves: int32 (devices, n, 2), (from, to) slots of the
        message / residual store that the end of a call moves; padded with
        (scratch, scratch).
    carried: int32 (devices, Lc, 2), the (replica, microbatch) of the previous
        batch's rows that each device reads in the window (padded with (0, 0)).
    fresh: int32 (devices, Lf, 2), the same for this call's batch.
    period: ticks per window.
    """

    plan: TickPlan
    opt_iteration: np.ndarray
    msg_moves: np.ndarray
    res_moves: np.ndarray
    carried: np.ndarray
    fresh: np.ndarray
    period: int


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


def steady_window(schedule: Schedule, remat: bool, devices: tuple[Worker, ...]) -> SteadyWindow:
    """Cut the steady-state window from the one-op-per-tick table of the stream and
    plan it (see the module docstring); ScheduleError if the table has none.
    `devices`: the live workers in row order."""
    table = PackedTicks.one_op_per_tick(schedule, TABLE_ITERATIONS)
    place = {
        (it, op): (w, t)
        for t, tick in enumerate(table.ticks)
        for w, entries in tick.items()
        for it, op in entries
    }
    first = [
        min(t for (it, _), (_, t) in place.items() if it == k) for k in range(TABLE_ITERATIONS)
    ]

    def window(k: int) -> list[list[tuple[Worker, int, Op]]]:
        return [
            sorted((w, it - k, op) for w, es in table.ticks[t].items() for it, op in es)
            for t in range(first[k], first[k + 1])
        ]

    k = next((k for k in (1, 2) if window(k) == window(k + 1)), None)
    if k is None or not {d for tick in window(k) for _, d, _ in tick} <= {-1, 0}:
        raise ScheduleError(
            f"{schedule.kind}: its tick table has no steady window of two iterations, so its "
            "microbatches cannot be carried across calls; use iterations=N calls"
        )
    start, period = first[k], first[k + 1] - first[k]
    _check_steps_inside(table, first)
    full = build_plan(table, remat, devices)
    here = slice(start, start + period)
    rows = jax.tree.map(lambda a: a[:, here], full.rows)
    index = {w: i for i, w in enumerate(devices)}
    opt_iteration = np.full((len(devices), period), CURRENT, np.int32)
    for t in range(period):
        for w, entries in table.ticks[start + t].items():
            for it, op in entries:
                if op.kind is Kind.OPT:
                    opt_iteration[index[w], t] = it - k + 1
    lanes, carried, fresh = _input_rows(rows, full, k, schedule.num_virtual_stages)
    msg_moves, res_moves = _moves(table, place, full, index, start + period, period, remat)
    plan = dataclasses.replace(
        full,
        rows=rows._replace(**lanes),
        inputs=np.zeros((len(devices), 0, 3), np.int32),  # not used: `carried` and `fresh` are
        updates=full.updates[here],
    )
    return SteadyWindow(plan, opt_iteration, msg_moves, res_moves, carried, fresh, period)


def _input_rows(
    rows: TickRow, full: TickPlan, k: int, S: int
) -> tuple[dict, np.ndarray, np.ndarray]:
    """The window's lanes with `iteration` PREVIOUS/CURRENT and `mb` indexing each
    device's [carried, fresh] input rows, and those rows' (replica, microbatch).
    `k`: the table iteration that is CURRENT in the window; S: the stages."""
    n = rows.update.shape[0]
    reads = [s in (0, S - 1) for _, s in full.branches]  # the first stage's input, the labels
    wanted: list[tuple[list, list]] = [([], []) for _ in range(n)]  # per device: prev, current
    cells = []  # (lane, device, tick, iteration, (replica, microbatch))
    lanes = {}
    for name in ("f", "b", "w"):
        lane = getattr(rows, name)
        it = np.where(lane.branch > 0, lane.iteration - k + 1, CURRENT).astype(np.int32)
        lanes[name] = lane._replace(iteration=it, mb=np.zeros_like(lane.mb))
        for d, t in zip(*np.nonzero(lane.branch), strict=True):
            if reads[lane.branch[d, t] - 1]:
                _, r, j = (int(v) for v in full.inputs[d, lane.mb[d, t]])
                if (r, j) not in wanted[d][it[d, t]]:
                    wanted[d][it[d, t]].append((r, j))
                cells.append((name, d, t, it[d, t], (r, j)))
    carried_n = max(1, *(len(prev) for prev, _ in wanted))
    for name, d, t, it, pair in cells:
        got = wanted[d][it].index(pair)
        lanes[name].mb[d, t] = got if it == PREVIOUS else carried_n + got
    fresh_n = max(1, *(len(cur) for _, cur in wanted))
    carried = np.zeros((n, carried_n, 2), np.int32)
    fresh = np.zeros((n, fresh_n, 2), np.int32)
    for d, (prev, cur) in enumerate(wanted):
        for out, pairs in ((carried, prev), (fresh, cur)):
            for i, pair in enumerate(pairs):
                out[d, i] = pair
    return lanes, carried, fresh


def _check_steps_inside(table: PackedTicks, first: list[int]) -> None:
    """Every W/BW steps its stage in its own window (gradients are not carried)."""

    def window_of(t: int) -> int:
        return int(np.searchsorted(first, t, side="right"))

    grads: dict[tuple[int, int, int], set[int]] = {}
    for t, tick in enumerate(table.ticks):
        for entries in tick.values():
            for it, op in entries:
                if op.kind in (Kind.W, Kind.BW, Kind.OPT):
                    grads.setdefault((it, op.stage, op.mb), set()).add(window_of(t))
    if any(len(windows) > 1 for windows in grads.values()):
        raise ScheduleError(
            "a microbatch's backward and its optimizer step fall in different windows, "
            "so its gradient would have to be carried; use iterations=N calls"
        )


def _moves(
    table: PackedTicks,
    place: dict[tuple[int, Op], tuple[Worker, int]],
    plan: TickPlan,
    index: dict[Worker, int],
    boundary: int,
    period: int,
    remat: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The (from, to) slot moves at a window's end, per device: each tensor made
    before `boundary` and read in the window after it is read there from slot
    `from`; the same read one window earlier (the window every call runs) reads `to`."""
    S = table.schedule.num_virtual_stages
    moves: dict[str, list[set[tuple[int, int]]]] = {
        "msg": [set() for _ in index],
        "res": [set() for _ in index],
    }

    def made(it: int, *ops: Op) -> int:
        return min(place[(it, op)][1] for op in ops if (it, op) in place)

    for t in range(boundary, boundary + period):
        for w, entries in table.ticks[t].items():
            d = index[w]
            for it, op in entries:
                if op.kind is Kind.OPT:
                    continue
                lane = getattr(plan.rows, LANE_OF[op.kind])
                s, j, r = op.stage, op.mb, op.replica
                reads = []  # (store, slot field, when the tensor was made)
                if s > 0 and (op.kind is Kind.F or remat):
                    reads.append(("msg", lane.in_slot, made(it, Op(Kind.F, s - 1, j, r))))
                if op.kind is not Kind.F and s < S - 1:
                    sources = (Op(Kind.B, s + 1, j, r), Op(Kind.BW, s + 1, j, r))
                    reads.append(("msg", lane.g_slot, made(it, *sources)))
                if op.kind is not Kind.F and not remat:
                    reads.append(("res", lane.res_r, made(it, Op(Kind.F, s, j, r))))
                for store, slots, when in reads:
                    if when < boundary:
                        moves[store][d].add((int(slots[d, t]), int(slots[d, t - period])))
    scratch = {"msg": plan.msg_slots, "res": plan.res_slots}
    out = []
    for store, per_device in moves.items():
        for pairs in per_device:
            froms, tos = [a for a, _ in pairs], [b for _, b in pairs]
            if len(set(froms)) != len(froms) or len(set(tos)) != len(tos):
                raise ScheduleError(f"the {store} slots of the steady window do not repeat")
        width = max(1, *map(len, per_device))
        arr = np.full((len(index), width, 2), scratch[store], np.int32)
        for d, pairs in enumerate(per_device):
            for i, pair in enumerate(sorted(pairs)):
                arr[d, i] = pair
        out.append(arr)
    return out[0], out[1]


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
        res: per dtype (R, residual size), the in-flight microbatches' residuals;
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
            msgs, res = _move(msgs, mm), _move(res, rm)
            if stash:  # each version sits in its microbatch's residual slot
                weights = _move(weights, rm)
            done = low.loss.loss(lax.psum(losses[PREVIOUS], low.topo.axes), count)
            done = jnp.where(live[PREVIOUS], done, jnp.nan)
            out = (params, opt, msgs, res, weights, losses[CURRENT])
            return (*(jax.tree.map(lambda a: a[None], t) for t in out), done)

        spec = low.topo.spec
        f = jax.shard_map(
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
        for name, lane in (("f", rows.f), ("b", rows.b), ("w", rows.w))
    }
    return rows._replace(**lanes, update=jnp.where(live[opt_iteration], rows.update, 0))


def _move(store: Buffers, moves: jax.Array) -> Buffers:
    """Slot moves[i, 0] -> slot moves[i, 1], all at once (a scratch index past the
    end of a store is clamped on read and dropped on write)."""
    return {k: b.at[moves[:, 1]].set(b[moves[:, 0]]) for k, b in store.items()}
