"""The steady-state window of an asynchronous tick table, planned for a carrying call.

The one-op-per-tick table of async-1f1b's overlapping stream repeats itself
after its first iteration: the ticks from the first op of iteration k to the
first op of iteration k+1 are the same for every k >= 1, iterations
renumbered. `steady_window` finds that span in a table of a few iterations,
cuts its tick rows out of the plan of the whole table (plan.py), and records
what a call that runs only the window needs besides: which of its ops belong
to the previous batch, which input rows each device reads of each batch, and
the slot moves that put every tensor crossing the window's end where the next
call's copy of the window reads it (the whole table's slot plan is not
periodic). async_carry.py compiles it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import PackedTicks, Tick
from pjit_pipe.lowering.tick_plan import LANE_OF, TickPlan, TickRow, build_plan

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
    ticks: the window's ticks of the long table (what the simulator prices).
    """

    plan: TickPlan
    opt_iteration: np.ndarray
    msg_moves: np.ndarray
    res_moves: np.ndarray
    carried: np.ndarray
    fresh: np.ndarray
    period: int
    ticks: tuple[Tick, ...]


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
    return SteadyWindow(
        plan, opt_iteration, msg_moves, res_moves, carried, fresh, period, table.ticks[here]
    )


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
    for name in ("f", "b", "w", "w2"):
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
    if plan.bres_slots:
        raise ScheduleError(
            "carrying microbatches across calls needs fused backwards (BW): a split "
            "stage's B-pool residuals are not carried; use iterations=N calls"
        )
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
