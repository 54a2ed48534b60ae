"""What a re-routed schedule is measured against under failures.

(The bound every schedule is measured against, `lower_bound`, is a price and
lives in `pjit_pipe.simulator.bounds`.)

- `drop_replica`: the usual fallback: replicas with a failed worker stop, the
  intact ones split the global batch and run the fault-free schedule.
- `naive_reroute`: peers take the orphaned microbatches, but with fused BW and
  an iteration barrier, so the extra work cannot fill their bubbles.
"""

from __future__ import annotations

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import ORDERS, FailedWorkers, assign, list_schedule
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator import best_of


def drop_replica(
    kind: str,
    stages: int,
    microbatches: int,
    replicas: int,
    failed: FailedWorkers,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    chunks: int = 1,
) -> Schedule:
    """The fault-free `kind` schedule on the intact replicas, relabelled 0..D_alive-1.

    They take ceil(D*m / D_alive) microbatches each so the global batch is
    unchanged; the optimizer is not staggered.
    """
    pattern = FailurePattern.of(replicas, stages, failed)
    alive = len(pattern.alive_replicas)
    if not alive:
        raise ScheduleError(
            f"drop_replica: every one of the {replicas} replicas has a failed worker ({pattern})"
        )
    per_replica = -(-replicas * microbatches // alive)  # ceil
    return make_schedule(kind, stages, per_replica, chunks, costs, mem_limit, replicas=alive)


def naive_reroute(
    schedule: Schedule,
    failed: FailedWorkers,
    costs: Costs | None = None,
    mem_limit: float | None = None,
) -> Schedule:
    """Re-route orphaned microbatches to peers without splitting B/W or staggering.

    Each worker's memory limit is `mem_limit`, or else its stage's peak in the
    input schedule (1F1B keeps its P-p profile); op priorities follow the
    input's order. Of the re-routed work interleaved, last or first, the
    shortest steady period is kept, so the baseline is not a straw man.
    """
    costs = costs or Costs()
    pattern = FailurePattern.of(schedule.replicas, schedule.stages, failed)
    peaks = peak_memory(schedule)
    caps = {
        w: mem_limit
        if mem_limit is not None
        else max(peaks[u] for u in schedule.workers if u.stage == w.stage)
        for w in schedule.workers
    }
    placement = assign(schedule, pattern)
    kind = f"{schedule.kind}+naive-reroute"
    runs = (
        list_schedule(
            schedule, pattern, placement, costs, caps, order, False, False, iterations=1, kind=kind
        )[0]
        for order in ORDERS
    )
    return validate(best_of(runs, costs))
