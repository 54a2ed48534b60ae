"""The exact engine: the makespan-optimal B/W-split schedule of one pipeline, as a MILP.

Heuristics need a reference to be judged against. For one replica and one
chunk per stage, this module writes the scheduling problem as a mixed-integer
program (the model itself: `pjit_pipe.schedules.milp`) and lets HiGHS
minimise the makespan:

- a start time per F, B and W of every (stage, microbatch), within a time
  window derived from the precedences and a feasible incumbent's makespan;
- a binary per pair of ops on one worker whose order is not forced, with
  disjunctive big-M constraints (the big-M of each pair comes from the windows);
- the precedences of `pjit_pipe.ir.engine.needs` with the durations of
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
from dataclasses import dataclass

import highspy
import numpy as np

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind, Op
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.schedules.auto import ExactSolver, auto
from pjit_pipe.schedules.common import check_positive, replicated
from pjit_pipe.schedules.milp import GAP, KINDS, PAIRS, Model, Problem, Program, build
from pjit_pipe.schedules.timing import Shape, Step, to_ops
from pjit_pipe.simulator import simulate

MAX_ORDER_BINARIES = 12_000
"""Largest model accepted: 3*P*m*(m-1)/2 ordering binaries (P=8, m=32 is 11904)."""


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
            elif op.kind in KINDS:
                kinds = (KINDS.index(op.kind),)
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
        lambda p, r: [Op(KINDS[k], p, j) for k, j in programs[p]],
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


def _solution(prob: Problem, model: Model, T: int, x: dict, programs: list[Program]):
    """Column values of the incumbent `programs` (times from their event simulation)."""
    sim = simulate(_schedule(programs), prob.costs)
    values = np.zeros(len(model.lo))
    for e in sim.events:
        if e.op.kind in KINDS:
            values[prob.idx(KINDS.index(e.op.kind), e.op.stage, e.op.mb)] = e.start
    values[T] = sim.makespan
    position = [{op: n for n, op in enumerate(ops)} for ops in programs]
    for (s, ka, kb, i, j), col in x.items():
        values[col] = float(position[s][ka, i] < position[s][kb, j])
    return values


def _programs(prob: Problem, x: dict, values: np.ndarray) -> list[Program]:
    """Each worker's order read off the binaries (a total order by the transitivity rows)."""
    programs = []
    for s in range(prob.P):
        rank = {(k, j): j for k in range(3) for j in range(prob.m)}  # same-kind predecessors
        for ka, kb in PAIRS:
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
    prob = Problem(stages, microbatches, costs, limit)
    if warm_start is None:
        warm_start = auto(stages, microbatches, 1, costs, mem_limit)
    incumbent = _fifo_programs(warm_start, stages, microbatches, mem_limit)
    upper, trivial = simulate(_schedule(incumbent), costs).makespan, prob.lower_bound()

    model, T, x = build(prob, limit, upper, min(trivial, upper))
    h = model.solver(T)
    h.setOptionValue("time_limit", max(time_limit - (time.perf_counter() - started), 1e-3))
    h.setOptionValue("mip_rel_gap", GAP / 2)
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
        optimal=gap <= GAP,
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
                if op.kind in KINDS
            ]
            for w in result.schedule.workers
        ]

    return refine


__all__ = ["MAX_ORDER_BINARIES", "ExactResult", "refiner", "solve_exact"]
