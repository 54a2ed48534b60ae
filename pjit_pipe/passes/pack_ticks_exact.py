"""The optimal tick table of a small schedule (one iteration), as a HiGHS MILP.

It solves the problem `pack_ticks` solves greedily, so that tests can measure
how far the greedy is from the optimum: place each compute op in a tick so
that the sum of the tick lengths is least (a tick lasts as long as its
slowest worker, a message leaving a worker after its op plus C), plus
`Costs.tick` for each tick that holds an op (as `packed_time` prices a
table: an empty tick is dropped from it), under the
lane rule of ir/ticks.py, every dependency (a message from an earlier tick,
a residual from an earlier lane) and the memory limit (the peak inside each
tick, in its lane order). A worker may run its ops in any order the
dependencies allow, as the greedy may. The lane order is fixed within one
MILP, so there is one per order (F, B, W and B, W, F), and the better wins,
as `pack_ticks` keeps the better of its tables.

Variables: x[i, t] = 1 when op i runs in tick t, each tick's length L_t and,
with a priced tick, u_t >= x[i, t] (continuous: at the optimum it is 0 or 1).
The horizon is the larger of the greedy's and the unpacked table's tick
counts (both feasible), so the optimum is over tables of at most that many ticks. OPTs run
at the end of the last tick. Only sizes of a few dozen ops solve quickly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import highspy
import numpy as np

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import Engine, Tensor
from pjit_pipe.ir.memory import MEMORY_DELTA, largest_peak, limit_units
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import (
    LANE_ORDERS,
    Entry,
    LaneOrder,
    PackedTicks,
    compute_only,
    is_message,
    lanes,
)
from pjit_pipe.passes.pack_ticks import pack_ticks


@dataclass(frozen=True)
class ExactResult:
    """What HiGHS found within its time limit: the best table (None if none was
    found), its time, and a proven lower bound on the optimum's time (equal to
    `time` when `optimal`)."""

    table: PackedTicks | None
    time: float
    bound: float
    optimal: bool


def exact_pack(
    schedule: Schedule,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    time_limit: float = 60.0,
) -> PackedTicks:
    """The cheapest one-iteration tick table of `schedule` (see the module docstring),
    within `mem_limit` (None: the schedule's own largest peak, as `pack_ticks`).
    Raises ScheduleError when HiGHS proves no optimum within `time_limit` seconds."""
    result = exact_bounds(schedule, costs, mem_limit, time_limit)
    if not result.optimal or result.table is None:
        raise ScheduleError(
            f"exact_pack: HiGHS found no optimum in {time_limit:g} s (best {result.time:g}, "
            f"lower bound {result.bound:g}); raise time_limit or use exact_bounds"
        )
    return result.table


def exact_bounds(
    schedule: Schedule,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    time_limit: float = 60.0,
) -> ExactResult:
    """Solve `exact_pack`'s MILP, once per lane order (ir/ticks.py), for at most
    `time_limit` seconds each, and report the best table found and the proven lower
    bound (the optimum lies between them)."""
    costs = costs or Costs()
    greedy = pack_ticks(schedule, costs, 1, mem_limit)
    unpacked = PackedTicks.one_op_per_tick(schedule)
    # Horizon: the greedy's and the unpacked table's tick counts (both feasible).
    horizon = max(len(greedy), len(unpacked))
    results = [
        # The greedy's table is HiGHS's first solution for its own order, the unpacked
        # table (valid in every order) for the other.
        _solve(
            schedule,
            costs,
            mem_limit,
            time_limit,
            order,
            horizon,
            greedy if greedy.order == order else unpacked,
        )
        for order in LANE_ORDERS
    ]
    best = min(results, key=lambda r: r.time)
    bound = min(r.bound for r in results)
    return ExactResult(best.table, best.time, bound, all(r.optimal for r in results))


def _solve(
    schedule: Schedule,
    costs: Costs,
    mem_limit: float | None,
    time_limit: float,
    order: LaneOrder,
    horizon: int,
    start_table: PackedTicks,
) -> ExactResult:
    """The MILP for tables of lane order `order` and at most `horizon` ticks, started
    from `start_table` (a feasible table of at most that many ticks, any order whose
    ticks also fit this one)."""
    sched = compute_only(schedule)
    flow, duration = Engine(sched), costs.duration_fn(sched)
    ops = [(w, op) for w, _, op in sched.ops() if op.kind in COMPUTE_KINDS]
    producer = {}
    for i, (w, op) in enumerate(ops):
        for key in flow.produces(w, op):
            producer[key] = i
    crosses = {key for w, op in ops for key, cross in flow.deps(w, op) if cross}

    def lane(i: int) -> int:  # the first lane op i occupies in the order
        return lanes(ops[i][1].kind, order)[0]

    n, T = len(ops), horizon
    x = lambda i, t: i * T + t  # noqa: E731
    length = lambda t: n * T + t  # noqa: E731
    used = lambda t: n * T + T + t  # noqa: E731  (1 when tick t holds an op; priced Costs.tick)
    ticked = costs.tick > 0
    cols = n * T + T + (T if ticked else 0)
    start = np.zeros(cols)
    tick_of = {(w, op): t for (w, _, op), (t, _) in start_table.placement().items()}
    for i, op_key in enumerate(ops):
        start[x(i, tick_of[op_key])] = 1.0
    # (producer, consumer, least tick gap): a message needs a later tick, and so
    # does a residual whose producer runs in a later lane than its consumer.
    edges = []
    for i, (w, op) in enumerate(ops):
        for key, _ in flow.deps(w, op):
            p = producer.get(key)
            if p is not None and isinstance(key, Tensor):
                edges.append((p, i, 1 if is_message(key, op) or lane(p) > lane(i) else 0))
    # Each op's window of ticks: after its longest chain of predecessors, before
    # its longest chain of successors (ops are listed per worker in program
    # order, and a dependency never points to a later-listed op's predecessor).
    early, late = [0] * n, [T - 1] * n
    for _ in range(n):
        changed = False
        for p, c, gap in edges:
            if early[c] < early[p] + gap:
                early[c], changed = early[p] + gap, True
            if late[p] > late[c] - gap:
                late[p], changed = late[c] - gap, True
        if not changed:
            break
    rows: list[tuple[float, float, dict[int, float]]] = []
    for i in range(n):
        rows.append((1, 1, {x(i, t): 1.0 for t in range(early[i], late[i] + 1)}))
        if ticked:  # a tick that holds an op is paid for (an empty one is dropped)
            for t in range(early[i], late[i] + 1):
                rows.append((-np.inf, 0, {x(i, t): 1.0, used(t): -1.0}))
                start[used(t)] = max(start[used(t)], start[x(i, t)])
    for p, c, gap in edges:  # by each tick t, c has run only if p ran by t - gap
        for t in range(early[c], late[c] + 1):
            coefs = {x(c, u): 1.0 for u in range(early[c], t + 1)}
            for u in range(early[p], min(t - gap, late[p]) + 1):
                coefs[x(p, u)] = -1.0
            rows.append((-np.inf, 0, coefs))
    by_worker: dict[Worker, list[int]] = {}
    for i, (w, _) in enumerate(ops):
        by_worker.setdefault(w, []).append(i)
    cap = limit_units(largest_peak(schedule) if mem_limit is None else mem_limit, sched.chunks)
    for mine in by_worker.values():
        for t in range(T):
            for position in range(3):
                coefs = {x(i, t): 1.0 for i in mine if position in lanes(ops[i][1].kind, order)}
                if len(coefs) > 1:
                    rows.append((-np.inf, 1, coefs))
            # The tick lasts at least until each op's end (plus C when it sends).
            for i in mine:
                w, op = ops[i]
                send = costs.c if any(k in crosses for k in flow.produces(w, op)) else 0.0
                coefs = {length(t): 1.0}
                for k in mine:
                    if lane(k) <= lane(i):
                        coefs[x(k, t)] = -duration(*ops[k]) - (send if k == i else 0.0)
                rows.append((0, np.inf, coefs))
                tick_end = -sum(start[k] * v for k, v in coefs.items() if k != length(t))
                start[length(t)] = max(start[length(t)], tick_end)
            if cap < np.inf:
                # The tick's peak: with F first, the memory before it plus its F (a
                # release counts after its tick); with F last, the memory after it.
                coefs = {}
                for i in mine:
                    d = MEMORY_DELTA[ops[i][1].kind]
                    counted = d > 0 or order[-1] is Kind.F
                    for u in range(t + 1 if counted else t):
                        coefs[x(i, u)] = coefs.get(x(i, u), 0.0) + d
                rows.append((-np.inf, cap, coefs))

    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(os.environ.get("PJIT_PIPE_HIGHS_LOG")))
    h.setOptionValue("time_limit", float(time_limit))
    cost = np.zeros(cols)
    cost[n * T : n * T + T] = 1.0
    cost[n * T + T :] = costs.tick
    lo, hi = np.zeros(cols), np.ones(cols)
    hi[n * T : n * T + T] = np.inf
    for i in range(n):  # outside its window an op cannot run
        hi[[x(i, t) for t in range(T) if not early[i] <= t <= late[i]]] = 0.0
    h.addCols(cols, cost, lo, hi, 0, [], [], [])
    starts, index, value = [], [], []
    for _, _, coefs in rows:
        starts.append(len(index))
        index.extend(coefs)
        value.extend(coefs.values())
    h.addRows(
        len(rows),
        np.array([r[0] for r in rows], dtype=np.float64),
        np.array([r[1] for r in rows], dtype=np.float64),
        len(index),
        np.array(starts, dtype=np.int32),
        np.array(index, dtype=np.int32),
        np.array(value, dtype=np.float64),
    )
    ints = np.arange(n * T, dtype=np.int32)
    h.changeColsIntegrality(
        len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger, dtype=np.uint8)
    )
    first = highspy.HighsSolution()
    first.col_value = list(start)
    h.setSolution(first)
    h.run()
    status, info = h.getModelStatus(), h.getInfo()
    optimal = status == highspy.HighsModelStatus.kOptimal
    if info.primal_solution_status != 2:  # no feasible solution within the time limit
        return ExactResult(None, math.inf, info.mip_dual_bound, False)
    sol = np.asarray(h.getSolution().col_value)
    ticks: list[dict[Worker, list[Entry]]] = [{} for _ in range(T)]
    for i, (w, op) in enumerate(ops):
        t = int(np.argmax(sol[i * T : (i + 1) * T]))
        ticks[t].setdefault(w, []).append((0, op))
    ticks = [tk for tk in ticks if tk]
    for w, _, op in sched.ops():
        if op.kind is Kind.OPT:
            ticks[-1].setdefault(w, []).append((0, op))
    ordered = tuple(
        {w: tuple(sorted(es, key=lambda e: _lane_key(e, order))) for w, es in tk.items()}
        for tk in ticks
    )
    table = PackedTicks(schedule, 1, ordered, order)
    best = info.objective_function_value
    return ExactResult(table, best, best if optimal else info.mip_dual_bound, optimal)


def _lane_key(entry: Entry, order: LaneOrder) -> int:
    return lanes(entry[1].kind, order)[0] if entry[1].kind in COMPUTE_KINDS else 3
