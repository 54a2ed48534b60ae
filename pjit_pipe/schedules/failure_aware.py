"""The failure-aware search: the best re-routed schedule for a failure pattern.

The re-routing rewrite itself (`pjit_pipe.passes.reroute`) takes one
assignment of orphaned microbatches to surviving peers and one priority order.
This search tries several of each, prices every candidate with the simulator,
and keeps the shortest steady iteration period under the memory limit; it
stops early at the work-conserving lower bound. `make_schedule(...,
failed=...)` calls it; nothing else should need to.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import ORDERS, assign, canonically, default_limit, list_schedule
from pjit_pipe.simulator import best_of, lower_bound


def search_reroutes(
    base: Schedule,
    pattern: FailurePattern,
    costs: Costs,
    mem_limit: float | None = None,
    time_limit: float = 10.0,
) -> Schedule:
    """The re-routed version of the fault-free `base` with the shortest steady period found.

    The base's op order gives the priorities. Tries every round-robin rotation
    and a block assignment of orphaned microbatches, each with re-routed work
    interleaved, last or first (with chunks > 1, each also without reserving
    memory for a microbatch's later chunks, which is faster when it does not
    get stuck). Stops as soon as a candidate reaches the work-conserving lower
    bound, or after `time_limit` seconds. `mem_limit` defaults to the base's
    peak memory. Patterns equal up to a permutation of replicas get one
    schedule, relabelled (unless the time limit cuts their searches at
    different points).
    """
    if base.asynchronous:
        raise ScheduleError(
            f"failed workers with schedule {base.kind} are not supported yet: re-routing "
            "rebuilds a synchronous iteration; use a synchronous kind such as 1f1b or zb-h1"
        )
    stages, kind = base.stages, base.kind
    target = lower_bound(stages, base.microbatches, base.replicas, pattern, costs, base.chunks)
    limit = default_limit(base, mem_limit)
    caps = dict.fromkeys(base.workers, limit)
    deadline = time.monotonic() + time_limit

    def candidates(pat: FailurePattern) -> Iterator[Schedule]:
        spread = max(len(pat.survivors(p)) for p in range(stages))
        assignments = [(k, False) for k in range(spread)] + [(0, True)]
        name = f"{kind}+reroute"
        reserves = (False,) if base.chunks == 1 else (False, True)  # same thing when v=1
        for order in ORDERS:
            for offset, blocks in assignments:
                placement = assign(base, pat, offset, blocks)
                for reserve in reserves:
                    try:
                        yield from list_schedule(
                            base, pat, placement, costs, caps, order, reserve=reserve, kind=name
                        )[1:]
                    except ScheduleError:
                        if reserve:
                            raise
                        # stuck without reservation: the reserving run follows
                if time.monotonic() > deadline:
                    return

    result = canonically(base, pattern, lambda pat: best_of(candidates(pat), costs, target))
    return validate(result, mem_limit=limit)
