"""Tick tables solved exactly: the MILP of one iteration's table, whole or in windows.

The problem is the one `pack_ticks` solves greedily: place each compute op in
a tick so that the sum of the tick lengths is least (a tick lasts as long as
its slowest worker, a message leaving a worker after its op plus C), plus
`Costs.tick` for each tick that holds an op (as `packed_time` prices a table:
an empty tick is dropped from it), under the lane rule of ir/ticks.py, every
dependency (a message from an earlier tick, a residual from an earlier lane)
and the memory bound (ir.memory.MemoryBound: the peak of the units and of each
residual pool's rows inside each tick, in its lane order). A worker
may run its ops in any order the dependencies allow, as the greedy may. The
lane order is fixed within one MILP. OPTs run at the end of the last tick, so
the tables are those of one iteration that steps every stage at its end
(valid for a staggered schedule too, which only asks that each stage step
before its next iteration). One MILP prices one send timing: messages leave
in the tick that fills them or, `deferred`, the late channel at the start of
the next tick (ir/ticks.py; a reader of a late message made in the tick
before starts C into its tick: one more continuous variable per late read
and tick, z >= x[reader, t] + x[producer, t - 1] - 1). `polish_ticks` solves
each window at its table's timing and keeps the window's table at the
cheaper of the two (tick_packing/send_timing.py).

Variables: x[i, t] = 1 when op i runs in tick t, each tick's length L_t and,
with a priced tick, u_t >= x[i, t] (continuous: at the optimum it is 0 or 1).
Each op gets a window of ticks (after its longest chain of predecessors,
before its longest chain of successors); an op whose window is one tick is a
constant, and rows that hold only constants are left out.

`solve_ticks` solves the whole table (pack_ticks_exact.py: only sizes of a
few dozen ops solve quickly) or, given `window=(t0, t1)`, only the ops a
start table places in ticks t0..t1, with every other op kept where it is: a
small MILP that HiGHS solves in a second or two. `polish_ticks` slides such
a window over a greedy's table and keeps each improvement: a
large-neighbourhood search, which finds what the greedy's one-tick-at-a-time
choices miss (reordering a few ticks' ops across workers at once).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import highspy
import numpy as np

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import Engine, Tensor
from pjit_pipe.ir.memory import MemoryBound
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Worker
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import (
    W_PER_TICK,
    Entry,
    LaneOrder,
    PackedTicks,
    compute_only,
    is_message,
    lanes,
    sends_late,
)
from pjit_pipe.simulator import TickPricer
from pjit_pipe.tick_packing.send_timing import at_cheaper_timing


@dataclass(frozen=True)
class ExactResult:
    """What HiGHS found within its time limit: the best table (None if none was
    found), its time, and a proven lower bound on the optimum's time (equal to
    `time` when `optimal`; with a window, a bound for that window's problem only)."""

    table: PackedTicks | None
    time: float
    bound: float
    optimal: bool


def polish_ticks(
    table: PackedTicks,
    costs: Costs,
    mem_limit: float | None = None,
    seconds: float = 2.0,
    width: int | None = None,
    rounds: int = 2,
) -> PackedTicks:
    """`table` (one iteration of a schedule that is not asynchronous) improved by re-solving
    windows of `width` ticks exactly (HiGHS, at most `seconds` each), half a
    window apart, for up to `rounds` sweeps or until a sweep finds nothing;
    never more expensive than `table`. mem_limit as in `pack_ticks`. The
    default width, 2P ticks for P stages, is about a microbatch's round trip
    through the pipeline (P forwards, P backwards), so one window can move
    everything one round trip holds in flight."""
    schedule = table.schedule
    if table.iterations != 1 or schedule.asynchronous:
        raise ValueError(
            "polish_ticks: table must hold one iteration of a schedule that is not "
            f"asynchronous (iterations={table.iterations}, asynchronous="
            f"{schedule.asynchronous}); polish one iteration's table, then repeat it"
        )
    width = width or max(4, 2 * schedule.stages)
    pricer = TickPricer(schedule, costs)
    best, price = table, pricer.time(table)
    step = max(1, width // 2)
    for _ in range(rounds):
        improved = False
        t0 = 0
        while t0 < len(best):
            window = (t0, min(len(best), t0 + width) - 1)
            found = solve_ticks(
                schedule,
                costs,
                mem_limit,
                seconds,
                best.order,
                len(best),
                best,
                window,
                best.deferred,
            )
            if found.table is not None:
                candidate, p = at_cheaper_timing(found.table, pricer)
                if p < price - 1e-9:
                    best, price, improved = candidate, p, True
            t0 += step
        if not improved:
            break
    return best


def solve_ticks(
    schedule: Schedule,
    costs: Costs,
    mem_limit: float | None,
    time_limit: float,
    order: LaneOrder,
    horizon: int,
    start_table: PackedTicks,
    window: tuple[int, int] | None = None,
    deferred: bool = False,
) -> ExactResult:
    """The MILP for tables of lane order `order` and at most `horizon` ticks, started
    from `start_table` (a feasible table of at most that many ticks, any order whose
    ticks also fit this one), priced with the late channel sent at the start of
    the next tick when `deferred` (ir/ticks.py). With `window`, only the ops the
    start table places in those ticks (inclusive) move, and only within them."""
    sched = compute_only(schedule)
    flow, duration = Engine(sched), costs.duration_fn(sched)
    ops = [(w, op) for w, _, op in sched.ops() if op.kind in COMPUTE_KINDS]
    producer = {}
    for i, (w, op) in enumerate(ops):
        for key in flow.produces(w, op):
            producer[key] = i
    crosses = {key for w, op in ops for key, cross in flow.deps(w, op) if cross}
    first_lane = [lanes(op.kind, order)[0] for _, op in ops]
    # Deferred, a late message adds no C to its sender's tick; its reader starts no
    # earlier than C into its tick when the message was made in the tick before.
    sent_late = [deferred and sends_late(op.kind, order) for _, op in ops]
    sends = [
        costs.c if not sent_late[i] and any(k in crosses for k in flow.produces(w, op)) else 0.0
        for i, (w, op) in enumerate(ops)
    ]
    took = [duration(w, op) for w, op in ops]
    # (producer, reader) of each message on the late channel.
    late_reads = [
        (producer[key], i)
        for i, (w, op) in enumerate(ops)
        for key, cross in flow.deps(w, op)
        if cross and key in producer and sent_late[producer[key]]
    ]

    n, T = len(ops), horizon
    x = lambda i, t: i * T + t  # noqa: E731
    length = lambda t: n * T + t  # noqa: E731
    used = lambda t: n * T + T + t  # noqa: E731  (1 when tick t holds an op; priced Costs.tick)
    ticked = costs.tick > 0
    # z[j, t] (continuous, 0 or 1 at the optimum): late read j's reader in tick t and
    # its producer in tick t - 1, so that the reader waits C.
    waits = n * T + T + (T if ticked else 0)
    z = lambda j, t: waits + j * T + t  # noqa: E731
    cols = waits + len(late_reads) * T
    placed = {(w, op): t for (w, _, op), (t, _) in start_table.placement().items()}
    tick_of = [placed[key] for key in ops]
    start = np.zeros(cols)
    for i in range(n):
        start[x(i, tick_of[i])] = 1.0
    for j, (p, i) in enumerate(late_reads):
        if tick_of[p] == tick_of[i] - 1:
            start[z(j, tick_of[i])] = 1.0
    # (producer, consumer, least tick gap): a message needs a later tick, and so
    # does a residual whose producer runs in a later lane than its consumer.
    edges = []
    for i, (w, op) in enumerate(ops):
        for key, _ in flow.deps(w, op):
            p = producer.get(key)
            if p is not None and isinstance(key, Tensor):
                gap = 1 if is_message(key, op) or first_lane[p] > first_lane[i] else 0
                edges.append((p, i, gap))
    early, late = [0] * n, [T - 1] * n
    if window is not None:
        t0, t1 = window
        for i, t in enumerate(tick_of):
            early[i], late[i] = (t0, t1) if t0 <= t <= t1 else (t, t)
    # Each op's window of ticks: after its longest chain of predecessors, before
    # its longest chain of successors.
    for _ in range(n):
        changed = False
        for p, c, gap in edges:
            if early[c] < early[p] + gap:
                early[c], changed = early[p] + gap, True
            if late[p] > late[c] - gap:
                late[p], changed = late[c] - gap, True
        if not changed:
            break
    fixed = [early[i] == late[i] for i in range(n)]
    free_ticks = {t for i in range(n) if not fixed[i] for t in range(early[i], late[i] + 1)}
    if late_reads:  # a tick's length depends on the tick before's late messages too
        free_ticks |= {t + 1 for t in free_ticks if t + 1 < T}

    rows: list[tuple[float, float, dict[int, float]]] = []
    lo, hi = np.zeros(cols), np.ones(cols)
    hi[n * T : n * T + T] = np.inf
    for i in range(n):  # outside its window an op cannot run
        hi[[x(i, t) for t in range(T) if not early[i] <= t <= late[i]]] = 0.0
        if fixed[i]:
            lo[x(i, early[i])] = 1.0
        else:
            rows.append((1, 1, {x(i, t): 1.0 for t in range(early[i], late[i] + 1)}))
    for p, c, gap in edges:  # by each tick t, c has run only if p ran by t - gap
        if fixed[p] and fixed[c]:
            continue
        for t in range(early[c], late[c] + 1):
            coefs = {x(c, u): 1.0 for u in range(early[c], t + 1)}
            for u in range(early[p], min(t - gap, late[p]) + 1):
                coefs[x(p, u)] = -1.0
            rows.append((-np.inf, 0, coefs))
    by_worker: dict[Worker, list[int]] = {}
    for i, (w, _) in enumerate(ops):
        by_worker.setdefault(w, []).append(i)
    at: list[list[int]] = [[] for _ in range(T)]  # the ops that may run in each tick
    for i in range(n):
        for t in range(early[i], late[i] + 1):
            at[t].append(i)

    senders_late = sorted({p for p, _ in late_reads})  # the ops that send a late message
    late_producers: dict[int, list[int]] = {}  # reader -> the producers of its late reads
    for p, i in late_reads:
        late_producers.setdefault(i, []).append(p)

    def tick_length(t: int, chosen: list[int]) -> float:
        """How long tick t of the start table lasts holding `chosen` (op indices): each
        op's end in lane order, plus C when it sends; deferred, an op that reads a
        late message made in tick t - 1 starts no earlier than C into the tick, and
        the tick lasts at least C when any late message was made then."""
        end = costs.c if any(tick_of[p] == t - 1 for p in senders_late) else 0.0
        for w in {ops[i][0] for i in chosen}:
            busy = 0.0
            for i in sorted((i for i in chosen if ops[i][0] == w), key=lambda i: first_lane[i]):
                if any(tick_of[p] == t - 1 for p in late_producers.get(i, ())):
                    busy = max(busy, costs.c)
                busy += took[i]
                end = max(end, busy + sends[i])
        return end

    bound = MemoryBound.of(sched, mem_limit)
    held = [bound.delta(op) for _, op in ops]  # op i's change of (units, B rows, W rows)
    in_start: list[list[int]] = [[] for _ in range(T)]
    for i, t in enumerate(tick_of):
        in_start[t].append(i)
    for t in range(T):
        start[length(t)] = tick_length(t, in_start[t])
        if ticked:
            start[used(t)] = 1.0 if in_start[t] else 0.0
        if t not in free_ticks:  # nothing in tick t moves: its length is a constant
            lo[length(t)] = hi[length(t)] = start[length(t)]
            if ticked:
                lo[used(t)] = hi[used(t)] = start[used(t)]
            continue
        if ticked:  # a tick that holds an op is paid for (an empty one is dropped)
            for i in at[t]:
                rows.append((-np.inf, 0, {x(i, t): 1.0, used(t): -1.0}))
            if deferred and t + 1 < T:  # no empty tick before a used one (see below)
                rows.append((-np.inf, 0, {used(t + 1): 1.0, used(t): -1.0}))
        for mine in by_worker.values():
            here = [i for i in mine if early[i] <= t <= late[i]]
            for position in range(3):
                # One op per lane, but W_PER_TICK W's in the W lane (a BW fills it).
                room = W_PER_TICK if order[position] is Kind.W else 1
                coefs = {
                    x(i, t): room if ops[i][1].kind is Kind.BW else 1.0
                    for i in here
                    if position in lanes(ops[i][1].kind, order)
                }
                if sum(coefs.values()) > room:
                    rows.append((-np.inf, room, coefs))
            # The tick lasts at least until each op's end (plus C when it sends).
            for i in here:
                coefs = {length(t): 1.0}
                for k in here:
                    if first_lane[k] <= first_lane[i]:
                        coefs[x(k, t)] = -took[k] - (sends[i] if k == i else 0.0)
                rows.append((0, np.inf, coefs))
        # Deferred: a late message made in tick t - 1 lands in tick t, which lasts at
        # least C; its reader starts C into tick t, so the tick lasts at least C
        # plus the reader's and its later lanes' ops.
        for p in senders_late:
            if early[p] <= t - 1 <= late[p]:
                rows.append((0, np.inf, {length(t): 1.0, x(p, t - 1): -costs.c}))
        for j, (p, i) in enumerate(late_reads):
            if not (early[i] <= t <= late[i] and early[p] <= t - 1 <= late[p]):
                hi[z(j, t)] = 0.0
                continue
            rows.append((-np.inf, 1, {x(i, t): 1.0, x(p, t - 1): 1.0, z(j, t): -1.0}))
            coefs = {length(t): 1.0, z(j, t): -costs.c}
            for k in by_worker[ops[i][0]]:
                if early[k] <= t <= late[k] and first_lane[k] >= first_lane[i]:
                    coefs[x(k, t)] = -took[k]
            rows.append((0, np.inf, coefs))
        # The tick's peak of each resource (units, B-pool rows, W-pool rows): with F
        # first, the memory before it plus its F (a release counts after its tick);
        # with F last, the memory after it. Only F allocates. Ops fixed in earlier
        # ticks add a constant, folded into the bound.
        for r, cap in enumerate(bound.caps):
            if cap == np.inf:
                continue
            for mine in by_worker.values():
                coefs, constant = {}, 0.0
                for i in mine:
                    d = held[i][r]
                    if d == 0:
                        continue
                    last = t if d > 0 or order[-1] is Kind.F else t - 1
                    if fixed[i]:
                        constant += d if early[i] <= last else 0.0
                        continue
                    for u in range(early[i], min(late[i], last) + 1):
                        coefs[x(i, u)] = coefs.get(x(i, u), 0.0) + d
                if coefs:
                    rows.append((-np.inf, cap - constant, coefs))

    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(os.environ.get("PJIT_PIPE_HIGHS_LOG")))
    h.setOptionValue("time_limit", float(time_limit))
    cost = np.zeros(cols)
    cost[n * T : n * T + T] = 1.0
    cost[n * T + T :] = costs.tick
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
    if deferred:
        # Dropping an empty tick would put a late message's reader in the tick right
        # after it, a wait the MILP did not price: only trailing ones go (with a
        # priced tick there are no others: the ticks used come first, rows above).
        ticks = ticks[: max(t for t, tk in enumerate(ticks) if tk) + 1]
    else:
        ticks = [tk for tk in ticks if tk]
    for w, _, op in sched.ops():
        if op.kind is Kind.OPT:
            ticks[-1].setdefault(w, []).append((0, op))
    ordered = tuple(
        {w: tuple(sorted(es, key=lambda e: _lane_key(e, order))) for w, es in tk.items()}
        for tk in ticks
    )
    table = PackedTicks(schedule, 1, ordered, order, deferred)
    best = info.objective_function_value
    return ExactResult(table, best, best if optimal else info.mip_dual_bound, optimal)


def _lane_key(entry: Entry, order: LaneOrder) -> int:
    return lanes(entry[1].kind, order)[0] if entry[1].kind in COMPUTE_KINDS else 3
