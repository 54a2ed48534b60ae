"""Peer re-routing: run failed workers' microbatches on surviving peers of the same stage.

Replicas hold identical stage parameters, so the microbatches of a failed
worker (r, p) can run stage p on any surviving (r', p): nothing is lost and no
spare is needed. The extra work fits the peers' bubbles only when the backward
is split into B and W (W waits for idle time) and each stage steps its
optimizer as soon as its own gradients are reduced (staggering).

Programs are built by the list scheduler of `pjit_pipe.passes.list_scheduler`
(a policy over the execution engine's rules) over a few back-to-back
iterations; later iterations are the steady-state ones.

`reroute` is the pass: one balanced assignment, op priorities taken from the
input schedule. The search over assignments and priority orders lives with the
generators, in `pjit_pipe.schedules.failure_aware`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern, inverse, permute_replicas
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes.list_scheduler import Placement, list_schedule
from pjit_pipe.simulator import best_of

FailedWorkers = FailurePattern | Iterable[tuple[int, int]]  # a pattern or its (replica, stage)s


def assign(
    schedule: Schedule, pattern: FailurePattern, offset: int = 0, blocks: bool = False
) -> Placement:
    """Which live worker runs each slot: own work stays home, orphans spread over survivors.

    All chunks of one orphaned microbatch go to the same peer. Orphans are
    dealt round-robin starting at survivor `offset` (or in contiguous blocks),
    so survivors' loads differ by at most one microbatch.
    """
    placement: Placement = {}
    for p in range(schedule.stages):
        held = schedule.held_stages(p)
        alive = pattern.survivors(p)
        orphans = [
            (j, r)
            for j in range(schedule.microbatches)
            for r in range(schedule.replicas)
            if r not in alive
        ]
        n = len(alive)
        for i, (j, r) in enumerate(orphans):
            k = (i * n) // len(orphans) if blocks else i
            peer = Worker(alive[(k + offset) % n], p)
            placement.update({(s, j, r): peer for s in held})
        for r in alive:
            placement.update(
                {(s, j, r): Worker(r, p) for s in held for j in range(schedule.microbatches)}
            )
    return placement


def default_limit(schedule: Schedule, mem_limit: float | None) -> float:
    """`mem_limit`, or else the schedule's own peak activation memory."""
    return max(peak_memory(schedule).values()) if mem_limit is None else mem_limit


def _symmetric_under(schedule: Schedule, perm: tuple[int, ...]) -> bool:
    moved = permute_replicas(schedule, perm)
    return moved.programs == schedule.programs and moved.failed == schedule.failed


def canonically(
    schedule: Schedule, pattern: FailurePattern, build: Callable[[FailurePattern], Schedule]
) -> Schedule:
    """Build for the canonical pattern and relabel back, when the input allows it.

    Patterns equal up to a permutation of replicas then share one schedule.
    """
    canon, perm = pattern.canonical()
    if not _symmetric_under(schedule, perm):
        return build(pattern)
    return permute_replicas(build(canon), inverse(perm))


def reroute(
    schedule: Schedule,
    failed: FailedWorkers,
    costs: Costs | None = None,
    mem_limit: float | None = None,
) -> Schedule:
    """Re-route the failed workers' microbatches to surviving peers; B/W split, staggered.

    `mem_limit` defaults to the input schedule's peak activation memory. The
    result validates under that limit.
    """
    costs = costs or Costs()
    pattern = FailurePattern.of(schedule.replicas, schedule.stages, failed)
    pattern = FailurePattern(schedule.replicas, schedule.stages, pattern.failed | schedule.failed)
    limit = default_limit(schedule, mem_limit)

    def build(pat: FailurePattern) -> Schedule:
        placement = assign(schedule, pat)
        caps = dict.fromkeys(schedule.workers, limit)
        runs = list_schedule(schedule, pat, placement, costs, caps, kind=f"{schedule.kind}+reroute")
        return best_of(runs[1:], costs)

    return validate(canonically(schedule, pattern, build), mem_limit=limit)
