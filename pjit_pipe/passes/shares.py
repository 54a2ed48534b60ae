"""Shares of slow workers' work: how many microbatch-slices each live worker runs, and which move.

A slow worker is a partial failure. Replicas hold identical stage parameters,
so any of a position's D*m microbatch-slices (one microbatch's chunks of that
position, of one home replica) can run on any live worker of that position.
`balanced_counts` picks how many each worker runs: counts that reach the least
possible largest load (`simulator.least_largest_load`, loads priced at each
worker's factor). `share_placement` turns counts into a `Placement`: a worker
with fewer slices than its own keeps some of its own microbatches and gives the
rest (a failed worker gives all), and the given slices are dealt to the
workers with more than their own.

Which counts, which microbatches stay and how the moved ones are dealt are the
knobs the failure-aware search (`pjit_pipe.schedules.failure_aware`) tries.
"""

from __future__ import annotations

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.passes.list_scheduler import Placement
from pjit_pipe.simulator import least_largest_load

TRIMS = ("slow", "fast")  # whose spare capacity is given up first, on ties
# Which slices a giving worker keeps: the first, the last or evenly spaced ones of its own
# microbatches, or ("homes") evenly spaced microbatches of every home replica in turn.
KEEPS = ("early", "late", "spread", "homes")


def balanced_counts(
    schedule: Schedule, pattern: FailurePattern, costs: Costs, trim: str = "slow"
) -> dict[Worker, int]:
    """Per live worker, how many of its position's microbatch-slices it runs.

    The counts reach the least possible largest load of each position (a
    slice costs the position's F+B+W times the worker's factor). The workers'
    capacities within that load add up to at least D*m; the spare is taken off
    one slice at a time from the worker whose load is then largest, ties going
    to the slowest worker first (`trim="slow"`) or the fastest (`"fast"`).

    Args:
        schedule: The fault-free schedule (its shape).
        pattern: Failed workers: they run nothing.
        costs: Per-position F, B, W and the slow workers' factors.
        trim: One of TRIMS.

    Returns:
        {live worker: slices}; per position they add up to D*m.

    Raises:
        ScheduleError: An unknown `trim`.
    """
    if trim not in TRIMS:
        raise ScheduleError(f"trim must be one of {', '.join(TRIMS)}, got {trim!r}")
    speeds = costs.factors()
    work = [sum(row) for row in costs.per_stage(schedule.stages)]
    total = schedule.replicas * schedule.microbatches
    counts: dict[Worker, int] = {}
    for p in range(schedule.stages):
        live = [Worker(r, p) for r in pattern.survivors(p)]
        unit = [max(work[p], 1e-12) * speeds.get(w, 1.0) for w in live]
        _, caps = least_largest_load(total, unit)
        sign = 1 if trim == "slow" else -1
        for _ in range(sum(caps) - total):
            i = max(
                (i for i in range(len(live)) if caps[i]),
                key=lambda i: (caps[i] * unit[i], sign * unit[i], -i),
            )
            caps[i] -= 1
        counts.update(zip(live, caps, strict=True))
    return counts


def _kept(microbatches: int, keep: int, how: str) -> list[int]:
    """Which of a worker's own microbatches it keeps, `keep` of them."""
    if how == "early":
        return list(range(keep))
    if how == "late":
        return list(range(microbatches - keep, microbatches))
    return sorted({(i * microbatches) // keep for i in range(keep)}) if keep else []


def _from_homes(
    start: int, keep: int, microbatches: int, replicas: int, taken: set[tuple[int, int]]
) -> list[tuple[int, int]]:
    """`keep` (microbatch, home replica) slices for a giving worker, one home replica
    after another from replica `start`, evenly spaced microbatches, none of `taken`.

    A slow worker that keeps only its own microbatches slows every round trip of
    its own replica's first stage, which then waits for them with its memory full;
    slices from every home spread those slow round trips over the replicas.
    """
    picks: list[tuple[int, int]] = []
    for i in range(keep):
        home = (start + i) % replicas
        want = (i * microbatches) // keep
        j = next(
            (want + d) % microbatches
            for d in range(microbatches)
            if ((want + d) % microbatches, home) not in taken | set(picks)
        )
        picks.append((j, home))
    return picks


def share_placement(
    schedule: Schedule,
    pattern: FailurePattern,
    counts: dict[Worker, int],
    keep: str = "early",
    blocks: bool = False,
    start: int = 0,
) -> Placement:
    """Which live worker runs each slot, given how many slices each runs (`counts`).

    A worker with fewer than its m own slices keeps `keep` ones ("early": the
    first of its own microbatches, "late": the last, "spread": evenly spaced,
    "homes": spread over every home replica, `_from_homes`); a failed worker
    keeps none. Every other worker keeps its own slices that no giving worker
    took. The rest, ordered by microbatch, are dealt to the workers still short
    of their counts: round-robin, or in contiguous blocks (`blocks`). All chunks
    of one microbatch on one position go to the same worker.

    Args:
        schedule: The fault-free schedule (its shape and layout).
        pattern: Failed workers.
        counts: {live worker: slices}, adding up to D*m per position.
        keep: One of KEEPS.
        blocks: Deal the moved slices in blocks rather than round-robin.
        start: With keep="homes", the home replica every giving worker starts from.

    Returns:
        The placement of every (virtual stage, microbatch, home replica).

    Raises:
        ScheduleError: An unknown `keep`, or counts that do not add up.
    """
    if keep not in KEEPS:
        raise ScheduleError(f"keep must be one of {', '.join(KEEPS)}, got {keep!r}")
    m, replicas = schedule.microbatches, schedule.replicas
    placement: Placement = {}
    for p in range(schedule.stages):
        held = schedule.held_stages(p)
        live = [Worker(r, p) for r in pattern.survivors(p)]
        if sum(counts[w] for w in live) != replicas * m:
            raise ScheduleError(
                f"counts of position {p} add up to {sum(counts[w] for w in live)}, "
                f"not replicas x microbatches = {replicas * m}"
            )
        runs: dict[Worker, list[tuple[int, int]]] = {}  # (microbatch, home replica) kept
        taken: set[tuple[int, int]] = set()
        for w in live:  # the giving workers choose first
            if counts[w] < m:
                if keep == "homes":
                    runs[w] = _from_homes(start, counts[w], m, replicas, taken)
                else:
                    runs[w] = [(j, w.replica) for j in _kept(m, counts[w], keep)]
                taken.update(runs[w])
        for w in live:
            if counts[w] >= m:
                runs[w] = [(j, w.replica) for j in range(m) if (j, w.replica) not in taken]
                taken.update(runs[w])
        moved = sorted({(j, r) for j in range(m) for r in range(replicas)} - taken)
        short = {w: counts[w] - len(runs[w]) for w in live if counts[w] > len(runs[w])}
        takers = list(short)
        turn = 0
        for slot in moved:
            if blocks:
                peer = next(w for w in takers if short[w])
            else:
                while not short[takers[turn % len(takers)]]:
                    turn += 1
                peer = takers[turn % len(takers)]
                turn += 1
            short[peer] -= 1
            runs[peer].append(slot)
        for w, slices in runs.items():
            placement.update({(s, j, r): w for s in held for j, r in slices})
    return placement
