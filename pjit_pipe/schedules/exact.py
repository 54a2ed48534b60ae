"""The exact engine: the makespan-optimal B/W-split schedule of one pipeline, as a MILP.

Heuristics need a reference to be judged against. For one replica and one
chunk per stage, this module writes the scheduling problem as a mixed-integer
program and lets HiGHS minimise the makespan:

- a start time per F, B and W of every (stage, microbatch), within a time
  window derived from the precedences and a feasible incumbent's makespan;
- a binary per pair of ops on one worker whose order is not forced, with
  disjunctive big-M constraints (the big-M of each pair comes from the windows);
- the precedences of `pjit_pipe.ir.dataflow` with the durations of
  `Costs.duration_fn` and the transfer time C between workers;
- the activation memory after each F (docs/design.md section 3), which is linear in
  the binaries, bounded by the limit.

The returned schedule is validated, and its event simulation is checked
against the MILP: simulating an order can only start ops earlier than the
MILP's times, and at a proven optimum it must reach the same makespan.

Symmetry breaking (FIFO per kind). Microbatches are interchangeable, and in
fact some optimal schedule runs, on every stage, its F's in microbatch order,
its B's in microbatch order and its W's in microbatch order. Take any feasible
timed schedule, keep every time slot and only relabel: on each stage the k-th
F slot (in time) gets microbatch k, the k-th B slot k, the k-th W slot k.
Each worker's sequence of kinds is unchanged, so exclusivity, memory (it
depends on kinds only) and makespan are unchanged. The dependencies still
hold, by counting: if the k-th F slot of stage s starts at t, the first k F
slots of stage s each consumed a distinct F of stage s-1 that ended by t - C,
so at least k F's of stage s-1 ended by t - C, and the k-th of them (now
microbatch k) did too. The same count shows that the k-th B slot of stage s
finds the k-th F of stage s and the k-th B of stage s+1 finished (+ C), and
that the k-th W slot finds the k-th B of its stage finished. So the engine
fixes these chains, and only orders across kinds remain: F_i vs B_j, F_i vs
W_j and B_i vs W_j with i > j (for i <= j the chains already force F_i, B_i
first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import highspy
import numpy as np

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind, Op
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.schedules.auto import ExactSolver, auto
from pjit_pipe.schedules.common import check_positive, replicated
from pjit_pipe.schedules.timing import Shape, Step, to_ops
from pjit_pipe.simulator.simulate import simulate

MAX_ORDER_BINARIES = 12_000
"""Largest model accepted: 3*P*m*(m-1)/2 ordering binaries (P=8, m=32 is 11904)."""

_KINDS = (Kind.F, Kind.B, Kind.W)
_PAIRS = ((0, 1), (0, 2), (1, 2))  # (earlier kind, later kind) of the ordering binaries
_GAP = 1e-6

Program = list[tuple[int, int]]  # one worker's ops as (kind index 0/1/2 = F/B/W, microbatch)


@dataclass(frozen=True)
class ExactResult:
    """A schedule from the exact engine and what is proven about it.

    makespan: the schedule's simulated makespan (event mode).
    lower_bound: no schedule under the same memory limit is faster.
    optimal: makespan is proven optimal (gap below 1e-6).
    gap: (makespan - lower_bound) / makespan.
    solve_seconds: wall time of the whole call.
    """

    schedule: Schedule
    makespan: float
    lower_bound: float
    optimal: bool
    gap: float
    solve_seconds: float


class _Problem:
    """Ops, durations, precedences and time windows of one (P, m, costs) instance."""

    def __init__(self, stages: int, microbatches: int, costs: Costs, limit: float | None):
        self.P, self.m = stages, microbatches
        table = costs.per_stage(stages)
        self.dur = [[row[k] for row in table] for k in range(3)]  # dur[kind][stage]
        self.costs = costs
        self.c, self.opt = costs.c, costs.opt
        self.n = 3 * stages * microbatches
        self.edges = list(self._edges(limit))
        self.est, self.tail = self._windows()

    def idx(self, k: int, s: int, j: int) -> int:
        return (s * 3 + k) * self.m + j

    def d(self, k: int, s: int) -> float:
        return self.dur[k][s]

    def _edges(self, limit: float | None) -> Iterator[tuple[int, int, float]]:
        """Fixed precedences (a, b, lag): start(b) >= start(a) + lag.

        Besides the dataflow and the FIFO chains, a memory limit L forces B's
        before F's: after F_i at most L microbatches are in flight and W_j never
        precedes B_j, so at least i+1-L B's ran before F_i.
        """
        P, m, c = self.P, self.m, self.c
        for s in range(P):
            f, b, w = (self.d(k, s) for k in range(3))
            for j in range(m):
                if s > 0:
                    yield self.idx(0, s - 1, j), self.idx(0, s, j), self.d(0, s - 1) + c
                if s < P - 1:
                    yield self.idx(1, s + 1, j), self.idx(1, s, j), self.d(1, s + 1) + c
                yield self.idx(0, s, j), self.idx(1, s, j), f
                yield self.idx(1, s, j), self.idx(2, s, j), b
                if j > 0:
                    yield self.idx(0, s, j - 1), self.idx(0, s, j), f
                    yield self.idx(1, s, j - 1), self.idx(1, s, j), b
                    yield self.idx(2, s, j - 1), self.idx(2, s, j), w
                if limit is not None and (needed := math.ceil(j + 1 - limit - 1e-9)) > 0:
                    yield self.idx(1, s, needed - 1), self.idx(0, s, j), b

    def load_before(self, k: int, s: int, j: int) -> float:
        """Work the FIFO chains force onto worker s before op (k, s, j) starts."""
        f, b, w = (self.d(x, s) for x in range(3))
        return (j * f, (j + 1) * f + j * b, (j + 1) * (f + b) + j * w)[k]

    def load_from(self, k: int, s: int, j: int) -> float:
        """Work the FIFO chains force onto worker s from the start of op (k, s, j) on."""
        f, b, w = (self.d(x, s) for x in range(3))
        rest = self.m - j
        return (rest * (f + b + w), rest * (b + w), rest * w)[k] + self.opt

    def _ops(self) -> Iterator[tuple[int, int, int]]:
        """(kind, stage, mb) in index order."""
        for s in range(self.P):
            for k in range(3):
                for j in range(self.m):
                    yield k, s, j

    def _windows(self) -> tuple[np.ndarray, np.ndarray]:
        """Longest paths: earliest start of every op, and least time from its start to the end.

        Both also count the work the chains force onto the op's worker before
        (after) it, which every other op of that worker waits behind F(s, 0).
        """
        preds: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        succs: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        for a, b, lag in self.edges:
            preds[b].append((a, lag))
            succs[a].append((b, lag))
        order, waiting = [], [len(p) for p in preds]
        ready = [a for a in range(self.n) if not waiting[a]]
        while ready:
            a = ready.pop()
            order.append(a)
            for b, _ in succs[a]:
                waiting[b] -= 1
                if not waiting[b]:
                    ready.append(b)
        ops = list(self._ops())
        est, tail = np.zeros(self.n), np.zeros(self.n)
        for a in order:
            k, s, j = ops[a]
            est[a] = max(
                [est[p] + lag for p, lag in preds[a]]
                + [est[self.idx(0, s, 0)] + self.load_before(k, s, j)]
            )
        for a in reversed(order):
            tail[a] = max([lag + tail[b] for b, lag in succs[a]] + [self.load_from(*ops[a])])
        return est, tail

    def windows(self, upper: float) -> tuple[np.ndarray, np.ndarray]:
        """(earliest, latest) start of every op in any schedule of makespan <= upper."""
        return self.est, upper - self.tail

    def lower_bound(self) -> float:
        """Makespan bound before any order is chosen: the longest path through the windows."""
        return float(np.max(self.est + self.tail))


class _Model:
    """Columns and rows of a MILP, passed to HiGHS in one go."""

    def __init__(self) -> None:
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def col(self, lo: float, hi: float, integer: bool = False) -> int:
        self.lo.append(lo)
        self.hi.append(hi)
        if integer:
            self.integer.append(len(self.lo) - 1)
        return len(self.lo) - 1

    def row(self, lo: float, hi: float, coefs: dict[int, float]) -> None:
        self.rows.append((lo, hi, coefs))

    def solver(self, objective_col: int) -> highspy.Highs:
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        n = len(self.lo)
        cost = np.zeros(n)
        cost[objective_col] = 1.0
        h.addCols(n, cost, np.array(self.lo), np.array(self.hi), 0, [], [], [])
        starts, index, value = [], [], []
        for _, _, coefs in self.rows:
            starts.append(len(index))
            index.extend(coefs)
            value.extend(coefs.values())
        h.addRows(
            len(self.rows),
            np.array([r[0] for r in self.rows]),
            np.array([r[1] for r in self.rows]),
            len(index),
            np.array(starts, dtype=np.int32),
            np.array(index, dtype=np.int32),
            np.array(value, dtype=np.float64),
        )
        ints = np.array(self.integer, dtype=np.int32)
        h.changeColsIntegrality(
            len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger, dtype=np.uint8)
        )
        return h


def _fifo_programs(schedule: Schedule, stages: int, microbatches: int, limit: float | None):
    """A warm-start schedule as FIFO-relabelled programs (BW split into B, W)."""
    if (schedule.stages, schedule.microbatches, schedule.chunks, schedule.replicas) != (
        stages,
        microbatches,
        1,
        1,
    ):
        raise ScheduleError(
            f"warm_start must have stages={stages}, microbatches={microbatches}, chunks=1 and "
            f"replicas=1; got {schedule.stages}, {schedule.microbatches}, {schedule.chunks}, "
            f"{schedule.replicas}"
        )
    if schedule.failed or schedule.has_comm() or list(schedule.layout) != list(range(stages)):
        raise ScheduleError(
            "warm_start must be a fault-free schedule without SEND/RECV on the plain layout"
        )
    try:
        validate(schedule, limit)
    except ScheduleError as err:
        raise ScheduleError(f"warm_start is not a valid schedule under the limit: {err}") from err
    programs = []
    for worker in schedule.workers:
        seen = [0, 0, 0]
        ops: Program = []
        for op in schedule.program(worker):
            if op.kind is Kind.BW:
                kinds: tuple[int, ...] = (1, 2)
            elif op.kind in _KINDS:
                kinds = (_KINDS.index(op.kind),)
            else:
                continue
            for k in kinds:
                ops.append((k, seen[k]))
                seen[k] += 1
        programs.append(ops)
    return programs


def _schedule(programs: list[Program]) -> Schedule:
    stages, microbatches = len(programs), len(programs[0]) // 3
    return replicated(
        "exact",
        stages,
        microbatches,
        1,
        lambda p, r: [Op(_KINDS[k], p, j) for k, j in programs[p]],
    )


def _check_arguments(stages, microbatches, mem_limit, time_limit) -> float | None:
    """Validate the request; return the effective memory limit (None: not binding)."""
    check_positive(stages=stages, microbatches=microbatches)
    if not isinstance(time_limit, int | float) or not time_limit > 0:
        raise ScheduleError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    binaries = 3 * stages * microbatches * (microbatches - 1) // 2
    if binaries > MAX_ORDER_BINARIES:
        raise ScheduleError(
            f"stages={stages}, microbatches={microbatches} is too large for the exact engine "
            f"({binaries} ordering variables, at most {MAX_ORDER_BINARIES}); use "
            "make_schedule('auto', ...)"
        )
    if mem_limit is None:
        return None
    if not isinstance(mem_limit, int | float):
        raise ScheduleError(f"mem_limit must be a number or None, got {mem_limit!r}")
    if not mem_limit >= 1:
        raise ScheduleError(
            f"mem_limit={mem_limit!r}: no schedule exists, every F holds one unit of "
            "activations (need mem_limit >= 1)"
        )
    return None if mem_limit >= microbatches else float(mem_limit)


def _build(
    prob: _Problem, limit: float | None, upper: float, lower: float
) -> tuple[_Model, int, dict]:
    """The MILP: start columns 0..n-1, the makespan column, and the ordering binaries."""
    P, m = prob.P, prob.m
    est, lst = prob.windows(upper)
    tol = 1e-9 * max(upper, 1.0)
    model = _Model()
    for a in range(prob.n):
        model.col(est[a], max(lst[a], est[a]))
    T = model.col(lower, upper)
    x: dict[tuple[int, int, int, int, int], int] = {}  # (s, ka, kb, i, j) -> "ka_i before kb_j"
    for a, b, lag in prob.edges:
        model.row(lag, math.inf, {b: 1.0, a: -1.0})
    for s in range(P):
        for ka, kb in _PAIRS:
            da, db = prob.d(ka, s), prob.d(kb, s)
            for i in range(m):
                for j in range(i):
                    a, b = prob.idx(ka, s, i), prob.idx(kb, s, j)
                    can_ab = est[a] + da <= lst[b] + tol
                    can_ba = est[b] + db <= lst[a] + tol
                    v = x[s, ka, kb, i, j] = model.col(0 if can_ba else 1, 1 if can_ab else 0, True)
                    if can_ab:  # x = 1: a ends before b starts
                        big = max(lst[a] + da - est[b], 0.0)
                        model.row(-math.inf, big - da, {a: 1.0, b: -1.0, v: big})
                    if can_ba:  # x = 0: b ends before a starts
                        big = max(lst[b] + db - est[a], 0.0)
                        model.row(-math.inf, -db, {b: 1.0, a: -1.0, v: -big})

    def rel(s: int, ka: int, i: int, kb: int, j: int) -> tuple[float, dict[int, float]]:
        """'ka_i before kb_j' on stage s (ka < kb) as constant + linear terms."""
        return (1.0, {}) if i <= j else (0.0, {x[s, ka, kb, i, j]: 1.0})

    def add(*terms: tuple[float, tuple[float, dict[int, float]]], lo=-math.inf, hi=math.inf):
        const, coefs = 0.0, {}
        for scale, (c0, lin) in terms:
            const += scale * c0
            for col, val in lin.items():
                coefs[col] = coefs.get(col, 0.0) + scale * val
        if coefs:
            model.row(lo - const, hi - const, coefs)

    for s in range(P):
        # Transitivity, so the binaries always describe one total order per worker:
        # along each chain (monotone) and across the three chains (no 3-cycle F<B<W<F).
        for ka, kb in _PAIRS:
            for i in range(m):
                for j in range(i):
                    if i + 1 < m:  # ka_{i+1} before kb_j  =>  ka_i before kb_j
                        add((1, rel(s, ka, i, kb, j)), (-1, rel(s, ka, i + 1, kb, j)), lo=0)
                    if j + 1 < i:  # ka_i before kb_j  =>  ka_i before kb_{j+1}
                        add((1, rel(s, ka, i, kb, j + 1)), (-1, rel(s, ka, i, kb, j)), lo=0)
        for i in range(m):
            for k in range(i):
                for j in range(m):
                    fb, bw, fw = rel(s, 0, i, 1, j), rel(s, 1, j, 2, k), rel(s, 0, i, 2, k)
                    add((1, fw), (-1, fb), (-1, bw), lo=-1)  # F<B and B<W => F<W
                    add((1, fw), (-1, fb), (-1, bw), hi=0)  # W<B and B<F => W<F
        f, b, w = (prob.d(k, s) for k in range(3))
        for j in range(m):
            # Energy cuts: the work of worker s that must follow each op fits before T.
            add(
                (1, (0.0, {T: 1.0, prob.idx(0, s, j): -1.0})),
                *((-b, rel(s, 0, j, 1, k)) for k in range(j)),
                *((-w, rel(s, 0, j, 2, k)) for k in range(j)),
                lo=prob.load_from(0, s, j),
            )
            add(
                (1, (0.0, {T: 1.0, prob.idx(1, s, j): -1.0})),
                *((f, rel(s, 0, i, 1, j)) for i in range(j + 1, m)),
                *((-w, rel(s, 1, j, 2, k)) for k in range(j)),
                lo=prob.load_from(1, s, j) + f * (m - j - 1),
            )
            add(
                (1, (0.0, {T: 1.0, prob.idx(2, s, j): -1.0})),
                *((f, rel(s, 0, i, 2, j)) for i in range(j + 1, m)),
                *((b, rel(s, 1, i, 2, j)) for i in range(j + 1, m)),
                lo=prob.load_from(2, s, j) + (f + b) * (m - j - 1),
            )
        if limit is not None:  # memory after F_i: (i+1) - (B's and W's before it)/2 <= limit
            halves = math.floor(2 * (limit - 1) + 1e-9)
            for i in range(halves // 2 + 1, m):
                add(
                    *((1, rel(s, 0, i, 1, j)) for j in range(i)),
                    *((1, rel(s, 0, i, 2, j)) for j in range(i)),
                    hi=halves,
                )
    return model, T, x


def _solution(prob: _Problem, model: _Model, T: int, x: dict, programs: list[Program]):
    """Column values of the incumbent `programs` (times from their event simulation)."""
    sim = simulate(_schedule(programs), prob.costs)
    values = np.zeros(len(model.lo))
    for e in sim.events:
        if e.op.kind in _KINDS:
            values[prob.idx(_KINDS.index(e.op.kind), e.op.stage, e.op.mb)] = e.start
    values[T] = sim.makespan
    position = [{op: n for n, op in enumerate(ops)} for ops in programs]
    for (s, ka, kb, i, j), col in x.items():
        values[col] = float(position[s][ka, i] < position[s][kb, j])
    return values


def _programs(prob: _Problem, x: dict, values: np.ndarray) -> list[Program]:
    """Each worker's order read off the binaries (a total order by the transitivity rows)."""
    programs = []
    for s in range(prob.P):
        rank = {(k, j): j for k in range(3) for j in range(prob.m)}  # same-kind predecessors
        for ka, kb in _PAIRS:
            for i in range(prob.m):
                for j in range(prob.m):
                    first = i <= j or round(values[x[s, ka, kb, i, j]]) == 1
                    rank[(kb, j) if first else (ka, i)] += 1
        programs.append(sorted(rank, key=rank.__getitem__))
    return programs


def solve_exact(
    stages: int,
    microbatches: int,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    time_limit: float = 10.0,
    warm_start: Schedule | None = None,
) -> ExactResult:
    """The makespan-optimal F/B/W schedule of one replica with one chunk per stage.

    Solves the MILP with HiGHS for at most about `time_limit` seconds, starting
    from `warm_start` (a valid schedule under `mem_limit`; by default the auto
    heuristic's), whose makespan also bounds the search. When
    time runs out the best schedule found is returned with optimal=False and
    the remaining gap. Raises ScheduleError for bad arguments, for sizes beyond
    MAX_ORDER_BINARIES, and when no schedule fits `mem_limit`.
    """
    started = time.perf_counter()
    limit = _check_arguments(stages, microbatches, mem_limit, time_limit)
    costs = costs or Costs()
    prob = _Problem(stages, microbatches, costs, limit)
    if warm_start is None:
        warm_start = auto(stages, microbatches, 1, costs, mem_limit)
    incumbent = _fifo_programs(warm_start, stages, microbatches, mem_limit)
    upper, trivial = simulate(_schedule(incumbent), costs).makespan, prob.lower_bound()

    model, T, x = _build(prob, limit, upper, min(trivial, upper))
    h = model.solver(T)
    h.setOptionValue("time_limit", max(time_limit - (time.perf_counter() - started), 1e-3))
    h.setOptionValue("mip_rel_gap", _GAP / 2)
    h.setOptionValue("random_seed", 0)
    start = highspy.HighsSolution()
    start.col_value = list(_solution(prob, model, T, x, incumbent))
    start.value_valid = True
    h.setSolution(start)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:  # the incumbent is a feasible point
        raise RuntimeError("exact engine: the MILP rejects its own incumbent (model bug)")
    info = h.getInfo()
    programs = incumbent
    if info.primal_solution_status == 2 and info.objective_function_value < upper:
        programs = _programs(prob, x, np.array(h.getSolution().col_value))
    bound = trivial
    if math.isfinite(info.mip_dual_bound):
        bound = max(bound, info.mip_dual_bound)

    schedule = validate(_schedule(programs), mem_limit)
    makespan = simulate(schedule, costs).makespan
    if programs is not incumbent and makespan > info.objective_function_value + 1e-6 * upper:
        raise RuntimeError(
            f"exact engine: simulated makespan {makespan} exceeds the MILP's "
            f"{info.objective_function_value} (model and dataflow disagree)"
        )
    if bound > makespan + 1e-6 * upper:
        raise RuntimeError(
            f"exact engine: lower bound {bound} above the makespan {makespan} found (model bug)"
        )
    bound = min(bound, makespan)
    gap = (makespan - bound) / makespan if makespan > 0 else 0.0
    return ExactResult(
        schedule=schedule,
        makespan=makespan,
        lower_bound=bound,
        optimal=gap <= _GAP,
        gap=gap,
        solve_seconds=time.perf_counter() - started,
    )


def refiner(time_limit: float = 10.0) -> ExactSolver:
    """An `auto(..., exact=...)` hook: replace auto's winner by the exact engine's schedule.

    It refines one-chunk, plain-layout winners small enough for the engine and
    keeps the winner (returns None) otherwise or when the engine finds nothing
    faster. It minimises makespan, whatever objective auto ranked by.
    """

    def refine(shape: Shape, mem_limit: float | None, programs) -> list[list[Step]] | None:
        P, m = shape.stages, shape.microbatches
        plain = shape.chunks == 1 and shape.layout == tuple(range(P))
        if not plain or 3 * P * m * (m - 1) // 2 > MAX_ORDER_BINARIES:
            return None
        costs = Costs(list(shape.f), list(shape.b), list(shape.w), shape.c, shape.opt)
        start = replicated("auto", P, m, 1, lambda p, r: to_ops(programs[p], r))
        before = simulate(start, costs).makespan
        result = solve_exact(P, m, costs, mem_limit, time_limit, warm_start=start)
        if result.makespan >= before:
            return None
        return [
            [
                Step(op.kind, op.stage, op.mb)
                for op in result.schedule.program(w)
                if op.kind in _KINDS
            ]
            for w in result.schedule.workers
        ]

    return refine


__all__ = ["MAX_ORDER_BINARIES", "ExactResult", "refiner", "solve_exact"]
