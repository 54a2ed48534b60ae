"""The failure-aware search: the best re-routed schedule for failed and slow workers.

The re-routing rewrite itself (`pjit_pipe.passes.reroute`) takes one
assignment of orphaned microbatches to surviving peers and one priority order.
A slow worker is a partial failure: part of its microbatch-slices move to the
peers of its stage (`pjit_pipe.passes.shares`). This search tries several
assignments and orders, prices every candidate with the simulator at the
workers' speeds, and keeps the shortest steady iteration period under the
memory limit; it stops early at the lower bound. `make_schedule(...,
failed=..., slow=...)` calls it; nothing else should need to.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import (
    KEEPS,
    ORDERS,
    TRIMS,
    Placement,
    assign,
    balanced_counts,
    canonically,
    default_limit,
    list_schedule,
    share_placement,
)
from pjit_pipe.simulator import best_of, fill_bound, lower_bound, slow_bound, steady_period

# With slow workers, after the sweep: SHAKES // workers list-scheduler runs of the best
# (order, placement) with every slot's F and B rank shifted by up to JITTER. A run costs
# about its number of workers; one in ~20 reached fill_bound where the sweep missed it by
# one on bench_slow's D=2 rows, and hardly any at D=8, so small meshes get more runs.
SHAKES = 384
JITTER = 2.5
# The list-scheduler run behind a candidate: (order, placement, reserve).
Origin = tuple[str, Placement, bool]


def _placements(base: Schedule, pat: FailurePattern, costs: Costs) -> list[Placement]:
    """The assignments of slices to workers the search tries, without repeats.

    Failures only: every round-robin rotation and a block assignment of the
    orphaned microbatches (`passes.assign`). With slow workers: the counts that
    reach each position's least largest load (`passes.balanced_counts`, both
    trims), each with every choice of the slices a giving worker keeps (its own
    first, last or evenly spaced microbatches, or evenly spaced ones of every
    home replica in turn, starting at a slow worker's replica or the next),
    the rest dealt round-robin or in blocks (`passes.share_placement`); then
    the plain failure assignment.
    """
    found: list[Placement] = []
    slow = [w for w, f in costs.factors().items() if w not in pat.failed and f > 1.0]
    if slow:
        # Where slices from every home start: a slow worker's replica or the next
        # (other starts found no shorter period on bench_slow's grid).
        homes_starts = sorted({(w.replica + d) % base.replicas for w in slow for d in (0, 1)})
        for trim in TRIMS:
            counts = balanced_counts(base, pat, costs, trim)
            for keep in KEEPS:
                starts = homes_starts if keep == "homes" else (0,)
                for blocks in (False, True):
                    for start in starts:
                        found.append(share_placement(base, pat, counts, keep, blocks, start))
        found.append(assign(base, pat))
    else:
        spread = max(len(pat.survivors(p)) for p in range(base.stages))
        found += [assign(base, pat, k) for k in range(spread)] + [assign(base, pat, 0, True)]
    unique: list[Placement] = []
    for placement in found:
        if placement not in unique:
            unique.append(placement)
    return unique


def search_reroutes(
    base: Schedule,
    pattern: FailurePattern,
    costs: Costs,
    mem_limit: float | None = None,
    time_limit: float = 10.0,
) -> Schedule:
    """The re-routed version of the fault-free `base` with the shortest steady period found.

    The base's op order gives the priorities. Tries each assignment of
    `_placements` (failed workers' microbatches to survivors, and with slow
    workers in `costs.slow` part of theirs to their peers), each with
    re-routed work interleaved, last or first (with chunks > 1, each also
    without reserving memory for a microbatch's later chunks, which is faster
    when it does not get stuck). With slow workers and no failure, the base
    itself is a candidate too (moving nothing may be best); when none of those
    reaches the target, the best run is repeated with its priorities perturbed
    (seeded runs, `priorities`' jitter, fewer on larger meshes). Candidates
    are priced at the slow workers' speeds. Stops as soon as a candidate
    reaches the lower bound (the work-conserving one, `slow_bound`, or with
    one chunk per device `fill_bound` at the memory limit), or after
    `time_limit` seconds. `mem_limit` defaults to the base's peak memory.
    Patterns equal up to a permutation of replicas get one schedule,
    relabelled (unless the time limit cuts their searches at different points,
    or workers are slow).
    """
    if base.asynchronous:
        raise ScheduleError(
            f"failed or slow workers with schedule {base.kind} are not supported yet: "
            "re-routing rebuilds a synchronous iteration; use a synchronous kind such as "
            "1f1b or zb-h1"
        )
    stages, kind = base.stages, base.kind
    slow = {w: f for w, f in costs.factors().items() if w not in pattern.failed and f > 1.0}
    shape = (stages, base.microbatches, base.replicas)
    target = lower_bound(*shape, pattern, costs, base.chunks)
    limit = default_limit(base, mem_limit)
    if slow:
        target = max(target, slow_bound(*shape, slow, pattern, costs))
    if base.chunks == 1:  # each worker's pipeline fill within the limit
        target = max(target, fill_bound(*shape, limit, slow, pattern, costs))
    caps = dict.fromkeys(base.workers, limit)
    deadline = time.monotonic() + time_limit
    name = f"{kind}+reroute"

    def candidates(pat: FailurePattern, origins: dict[int, Origin]) -> Iterator[Schedule]:
        """Every run of the sweep; `origins` records the run behind each (by id)."""
        if slow and not pat.failed:
            yield base
        reserves = (False,) if base.chunks == 1 else (False, True)  # same thing when v=1
        placements = _placements(base, pat, costs)
        for order in ORDERS:
            for placement in placements:
                for reserve in reserves:
                    try:
                        runs = list_schedule(
                            base, pat, placement, costs, caps, order, reserve=reserve, kind=name
                        )[1:]
                    except ScheduleError:
                        if reserve:
                            raise
                        continue  # stuck without reservation: the reserving run follows
                    for run in runs:
                        origins[id(run)] = (order, placement, reserve)
                        yield run
                if time.monotonic() > deadline:
                    return

    def shaken(pat: FailurePattern, origin: Origin) -> Iterator[Schedule]:
        """The run `origin` again with its priorities perturbed (seeded: the same
        every call).

        The base's ranks are one fixed interleaving; where workers of a stage carry
        unequal loads it can leave the busiest one idle at the end of an iteration
        (its last backward comes too late for the previous stage's optimizer), and
        a shifted order often closes that gap (benchmarks/bench_slow.py's grid).
        """
        order, placement, reserve = origin
        rng = random.Random(0)
        slots = sorted(placement)
        for _ in range(SHAKES // len(base.workers)):
            if time.monotonic() > deadline:
                return
            jitter = {s: (rng.uniform(0, JITTER), rng.uniform(0, JITTER)) for s in slots}
            try:
                yield from list_schedule(
                    base,
                    pat,
                    placement,
                    costs,
                    caps,
                    order,
                    reserve=reserve,
                    kind=name,
                    jitter=jitter,
                )[1:]
            except ScheduleError:
                continue  # stuck without reservation

    def build(pat: FailurePattern) -> Schedule:
        """The candidate with the shortest steady period, stopping at the target; with
        slow workers, the best run shaken when the sweep falls short of it."""
        origins: dict[int, Origin] = {}
        best = best_of(candidates(pat, origins), costs, target)
        if slow and id(best) in origins and steady_period(best, costs) > target + 1e-9:
            best = best_of(itertools.chain([best], shaken(pat, origins[id(best)])), costs, target)
        return best

    result = build(pattern) if slow else canonically(base, pattern, build)
    return validate(result, mem_limit=limit)
