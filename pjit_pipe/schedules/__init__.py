"""Schedule generators: build an IR schedule from (kind, P, m, v, costs, memory limit).

`make_schedule` is the one entry point the CLI, the frontend and the benchmarks use;
given failed workers it runs the failure-aware search (`failure_aware`).

Kinds, their chunk counts and what they need (m microbatches, P stages):

  gpipe             chunks 1; peak memory m
  1f1b              chunks 1; peak memory min(P, m)
  interleaved-1f1b  chunks >= 2 (default 2); m a multiple of P
  zb-h1             chunks 1; peak memory <= P (1F1B's)
  zb-h2             chunks 1; peak memory <= 2P
  zb-v              chunks 2; peak memory <= P; order found for the given costs
  auto              any chunks (default 1); mem_limit >= 1; costs-aware search
  async-1f1b        chunks 1; m >= P; no flush, an OPT after every BW (PipeDream)

A fixed kind given a mem_limit below its own peak memory raises ScheduleError
(that peak is the kind's exact minimum) rather than returning another schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.passes import fuse_where_free
from pjit_pipe.schedules.asynchronous import async_one_f_one_b
from pjit_pipe.schedules.auto import OBJECTIVES, Objective, auto
from pjit_pipe.schedules.classic import gpipe, one_f_one_b
from pjit_pipe.schedules.common import check_positive
from pjit_pipe.schedules.failure_aware import search_reroutes
from pjit_pipe.schedules.interleaved import interleaved_1f1b
from pjit_pipe.schedules.zbv import zb_v
from pjit_pipe.schedules.zero_bubble import zb_h1, zb_h2

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "auto", "async-1f1b")

# Chunks per position when none are asked for (interleaved-1f1b takes any >= 2, auto any).
DEFAULT_CHUNKS = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "zb-h1": 1,
    "zb-h2": 1,
    "zb-v": 2,
    "auto": 1,
    "async-1f1b": 1,
}

_GENERATORS: dict[str, Callable[[int, int, int, int, Costs], Schedule]] = {
    "gpipe": lambda P, m, v, D, costs: gpipe(P, m, D),
    "1f1b": lambda P, m, v, D, costs: one_f_one_b(P, m, D),
    "interleaved-1f1b": lambda P, m, v, D, costs: interleaved_1f1b(P, m, v, D),
    "zb-h1": lambda P, m, v, D, costs: zb_h1(P, m, D),
    "zb-h2": lambda P, m, v, D, costs: zb_h2(P, m, D),
    "zb-v": lambda P, m, v, D, costs: zb_v(P, m, D, costs),
    "async-1f1b": lambda P, m, v, D, costs: async_one_f_one_b(P, m, D),
}


def _check_chunks(kind: str, chunks: int) -> None:
    if kind in ("auto", "interleaved-1f1b"):
        return  # auto takes any; interleaved_1f1b explains its own requirement
    if chunks != DEFAULT_CHUNKS[kind]:
        raise ScheduleError(f"{kind} needs chunks={DEFAULT_CHUNKS[kind]} (got chunks={chunks})")


def make_schedule(
    kind: str,
    stages: int,
    microbatches: int,
    chunks: int | None = None,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    replicas: int = 1,
    *,
    objective: Objective = "makespan",
    exact_time_limit: float | None = None,
    failed: FailurePattern | Iterable[tuple[int, int]] = (),
    search_time: float = 10.0,
) -> Schedule:
    """Generate a schedule of `kind` (one of KINDS), re-routed around `failed` workers.

    The one entry point the CLI, the frontend and the benchmarks use. It never
    returns a silently different schedule: a request no schedule of that kind
    can meet raises, naming the parameter. Costs with fused prices
    (`Costs.f_fused`, `Costs.bw`, as `costs="measure"` gives) also fuse back
    the backward of each stage whose split makes the steady period longer
    (`passes.fuse_backward`; the kind then ends in "+fused"); without them (the
    CLI's F,B,W costs) the schedule is the kind's own.

    Args:
        kind: One of KINDS (see the module docstring for what each needs).
        stages: P, pipeline positions per replica.
        microbatches: m per replica per iteration.
        chunks: Virtual stages per position; None takes the kind's own
            (DEFAULT_CHUNKS).
        costs: Op costs that steer zb-v, auto and the failure-aware search
            (default: `Costs()`, unit F, B, W).
        mem_limit: Bound on each worker's in-flight activations, in units of
            one microbatch's activations on one stage, or None for no limit.
            With `failed`, it bounds the re-routed schedule too (default: the
            fault-free one's peak).
        replicas: D data-parallel copies of the pipeline.
        objective: "makespan" or "span" (see `pjit_pipe.schedules.auto`);
            steers auto only.
        exact_time_limit: Seconds for which auto hands its best schedule to
            the exact MILP engine (`pjit_pipe.schedules.exact`) to improve or
            prove it; auto only.
        failed: Failed workers, as (replica, stage) pairs or a FailurePattern.
            When some are given, the fault-free schedule is the starting point
            of the failure-aware search (`pjit_pipe.schedules.failure_aware`),
            which re-routes their microbatches to surviving peers.
        search_time: At most this many seconds for that search.

    Returns:
        The schedule; its `kind` names the generator (and passes, e.g.
        "+fused") that made it.

    Raises:
        ScheduleError: An unknown kind or objective; stages, microbatches,
            chunks or replicas not a positive integer; chunks the kind does not
            take; negative costs or per-stage costs of the wrong length;
            mem_limit not a number, or below a fixed kind's own peak memory
            (that peak is the kind's exact minimum; raise it or use auto);
            exact_time_limit with a kind other than auto; or a kind's own
            requirement unmet (e.g. interleaved-1f1b's m a multiple of P).
        FailurePlanError: A failed worker outside the replicas x stages mesh,
            every replica of a stage failed, or a FailurePattern made for
            another mesh.
    """
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    if objective not in OBJECTIVES:
        raise ScheduleError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    chunks = DEFAULT_CHUNKS[kind] if chunks is None else chunks
    check_positive(stages=stages, microbatches=microbatches, chunks=chunks, replicas=replicas)
    _check_chunks(kind, chunks)
    costs = costs or Costs()
    costs.per_stage(stages)  # rejects negative costs and wrong per-stage lists
    if mem_limit is not None and not isinstance(mem_limit, int | float):
        raise ScheduleError(f"mem_limit must be a number or None, got {mem_limit!r}")
    if exact_time_limit is not None and kind != "auto":
        raise ScheduleError(f"exact_time_limit (--exact) applies to kind 'auto' only, not {kind!r}")
    pattern = FailurePattern.of(replicas, stages, failed)
    schedule = _fault_free(
        kind, stages, microbatches, chunks, costs, mem_limit, replicas, objective, exact_time_limit
    )
    if pattern.failed:
        schedule = search_reroutes(schedule, pattern, costs, mem_limit, search_time)
    return fuse_where_free(schedule, costs)


def _fault_free(
    kind: str,
    stages: int,
    microbatches: int,
    chunks: int,
    costs: Costs,
    mem_limit: float | None,
    replicas: int,
    objective: Objective,
    exact_time_limit: float | None,
) -> Schedule:
    if kind == "auto":
        exact = None
        if exact_time_limit is not None:
            from pjit_pipe.schedules.exact import refiner  # exact imports auto: import late

            exact = refiner(exact_time_limit)
        return auto(stages, microbatches, chunks, costs, mem_limit, replicas, objective, exact)
    schedule = _GENERATORS[kind](stages, microbatches, chunks, replicas, costs)
    if mem_limit is not None:
        peak = max(peak_memory(schedule).values())
        if peak > mem_limit + 1e-9:
            raise ScheduleError(
                f"mem_limit={mem_limit:g} is below {kind}'s peak memory {peak:g} at "
                f"stages={stages}, microbatches={microbatches}; raise it or use auto"
            )
    return schedule


def schedule_with_failures(
    kind: str,
    stages: int,
    microbatches: int,
    replicas: int,
    failed: FailurePattern | Iterable[tuple[int, int]],
    costs: Costs | None = None,
    mem_limit: float | None = None,
    chunks: int | None = None,
    time_limit: float = 10.0,
) -> Schedule:
    """The failure-aware search from the fault-free `kind` schedule, even with no failure.

    `make_schedule(..., failed=...)` is the entry point; this form always
    re-routes (B/W split, staggered), which the tests use to compare the
    re-routed program with the fault-free one.
    """
    costs = costs or Costs()
    pattern = FailurePattern.of(replicas, stages, failed)
    base = make_schedule(kind, stages, microbatches, chunks, costs, mem_limit, replicas)
    return search_reroutes(base, pattern, costs, mem_limit, time_limit)


__all__ = ["DEFAULT_CHUNKS", "KINDS", "make_schedule", "schedule_with_failures"]
