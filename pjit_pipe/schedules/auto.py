"""auto: the fastest schedule found for the given per-stage costs and memory limit.

Candidates are the greedy engine (`heuristic.py`) under a handful of
policies, on every layout that fits the chunk count, plus the fixed kinds of
that chunk count whose peak memory fits the limit, so auto is never worse
than them. All are priced with the fast evaluator and the best by `objective`
wins: "makespan" (one iteration, all workers; the default) or "span" (the
busiest worker's first-to-last op, what a staggered optimizer step achieves),
the other figure breaking ties. An exact solver can refine the winner.

Memory: any schedule holds one microbatch's activations on every chunk of a
worker at once (the last stage's backward needs them all), so auto needs
mem_limit >= 1 (MIN_MEMORY); with that it always finds a schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import COMPUTE_KINDS, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError, interleaved_layout, v_layout
from pjit_pipe.schedules.classic import gpipe, one_f_one_b
from pjit_pipe.schedules.common import replicated
from pjit_pipe.schedules.heuristic import Policy, greedy
from pjit_pipe.schedules.interleaved import interleaved_1f1b
from pjit_pipe.schedules.timing import Shape, Step, evaluate, to_ops
from pjit_pipe.schedules.zbv import zb_v
from pjit_pipe.schedules.zero_bubble import zb_h1, zb_h2

Objective = Literal["makespan", "span"]
OBJECTIVES = ("makespan", "span")
MIN_MEMORY = 1.0

Programs = tuple[tuple[Step, ...], ...]
# (shape, memory limit, best programs found) -> better programs, or None to keep them.
ExactSolver = Callable[[Shape, float | None, Programs], Sequence[Sequence[Step]] | None]


def critical_caps(shape: Shape, round_up: bool) -> tuple[int, ...]:
    """Warm-up caps from the costs: how many microbatches position p can start
    before the gradient of its first one comes back, if nothing waits."""
    S = shape.num_virtual
    start = [0.0] * S  # earliest start of F(s) of microbatch 0
    for s in range(1, S):
        start[s] = start[s - 1] + shape.f[s - 1] + shape.latency(s - 1, s)
    back = [0.0] * S  # earliest arrival of B(s)'s input gradient
    back[S - 1] = start[S - 1] + shape.f[S - 1]
    for s in range(S - 2, -1, -1):
        back[s] = back[s + 1] + shape.b[s + 1] + shape.latency(s + 1, s)
    caps = []
    for p in range(shape.stages):
        held = shape.held(p)
        per_mb = sum(shape.f[s] for s in held)
        if per_mb <= 0:
            caps.append(shape.microbatches)
            continue
        x = (back[held[0]] - start[held[0]]) / per_mb
        caps.append(max(1, math.ceil(x - 1e-9) if round_up else math.floor(x + 1e-9)))
    return tuple(caps)


def policies(shape: Shape) -> list[Policy]:
    """The policies auto tries on one layout."""
    P = shape.stages
    caps: list[tuple[int, ...] | None] = [
        None,
        critical_caps(shape, round_up=False),
        critical_caps(shape, round_up=True),
    ]
    if shape.layout == interleaved_layout(P, shape.chunks):
        caps += [tuple(P - p for p in range(P)), tuple(2 * (P - p) - 1 for p in range(P))]
    unique = list(dict.fromkeys(caps))
    out = [Policy(c, fill) for c in unique for fill in ("eager", "fit")]
    if shape.chunks > 1:  # tighter orders that may deadlock; greedy() then returns None
        out += [Policy(c, "eager", reserve=False) for c in unique]
    return out


def layouts(stages: int, chunks: int) -> list[tuple[int, ...]]:
    """Placements auto considers: interleaved always, the V too for two chunks."""
    out = [interleaved_layout(stages, chunks)]
    if chunks == 2:
        out.insert(0, v_layout(stages))
    return out


def fixed_candidates(
    stages: int, microbatches: int, chunks: int, costs: Costs, mem_limit: float | None
) -> list[Schedule]:
    """The fixed kinds of this chunk count whose peak memory fits the limit."""
    if chunks == 1:
        builders = [gpipe, one_f_one_b, zb_h1, zb_h2]
        found = [b(stages, microbatches) for b in builders]
    else:
        found = [zb_v(stages, microbatches, costs=costs)] if chunks == 2 else []
        if microbatches % stages == 0:
            found.append(interleaved_1f1b(stages, microbatches, chunks))
    if mem_limit is None:
        return found
    return [s for s in found if max(peak_memory(s).values()) <= mem_limit + 1e-9]


def _steps(schedule: Schedule) -> Programs:
    return tuple(
        tuple(
            Step(op.kind, op.stage, op.mb)
            for op in schedule.program(Worker(0, p))
            if op.kind in COMPUTE_KINDS
        )
        for p in range(schedule.stages)
    )


def auto(
    stages: int,
    microbatches: int,
    chunks: int,
    costs: Costs,
    mem_limit: float | None,
    replicas: int = 1,
    objective: Objective = "makespan",
    exact: ExactSolver | None = None,
) -> Schedule:
    """The best schedule found by `objective`; ScheduleError if mem_limit < MIN_MEMORY."""
    if objective not in OBJECTIVES:
        raise ScheduleError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if mem_limit is not None and mem_limit < MIN_MEMORY:
        raise ScheduleError(
            f"mem_limit={mem_limit:g} is below {MIN_MEMORY:g}: every schedule holds one "
            f"microbatch's activations on each worker"
        )
    scored: list[tuple[tuple[float, float], int, Shape, Programs]] = []
    for layout in layouts(stages, chunks):
        shape = Shape.of(stages, chunks, microbatches, layout, costs)
        for policy in policies(shape):
            plan = greedy(shape, mem_limit, policy)
            if plan is not None:
                scored.append((plan.timing.score(objective), len(scored), shape, plan.programs))
    for schedule in fixed_candidates(stages, microbatches, chunks, costs, mem_limit):
        shape = Shape.of(stages, chunks, microbatches, schedule.layout, costs)
        programs = _steps(schedule)
        scored.append((evaluate(shape, programs).score(objective), len(scored), shape, programs))
    _, _, shape, programs = min(scored)
    if exact is not None and (better := exact(shape, mem_limit, programs)) is not None:
        programs = tuple(map(tuple, better))
    return replicated(
        "auto",
        stages,
        microbatches,
        replicas,
        lambda p, r: to_ops(programs[p], r),
        chunks=chunks,
        layout=shape.layout,
    )


__all__ = ["MIN_MEMORY", "OBJECTIVES", "ExactSolver", "Objective", "auto"]
