"""How the greedy (tick_packing/greedy.py) picks a tick's length, and so each
worker's ops in it, from the workers' ready ops.

Each worker offers its ready ops oldest first, each with the time the worker
would keep the tick if the tick kept the ops up to it. A rule (`RULES`) picks
one length: the shortest that lets every ready worker run one op, the
longest anyone asks for, or the one that keeps the workers busiest per unit
of tick (`utilization`); each worker then runs its longest prefix that fits.
"""

from __future__ import annotations

from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.ticks import Entry, LaneOrder, lane_order

# How the greedy picks each tick's length from the workers' ready prefixes.
RULES = ("utilization", "shortest", "longest")


def _within(picks: list[tuple[Entry, float]], length: float) -> int:
    """How many of a worker's picks (oldest first) fit a tick of `length`: the longest
    prefix whose time does (a fused loss-stage group can make a longer prefix
    cheaper than a shorter one)."""
    return max((n for n, (_, tm) in enumerate(picks, 1) if tm <= length), default=0)


def cut(
    picks: dict[Worker, list[tuple[Entry, float]]], rule: str, order: LaneOrder
) -> dict[Worker, tuple[Entry, ...]]:
    """Each worker's longest list of picks (oldest first) within the tick length the
    rule picks, in lane order."""
    firsts = [p[0][1] for p in picks.values() if p]
    if not firsts:
        return {}
    floor = max(firsts)  # every ready worker runs at least one op
    lengths = sorted({tm for p in picks.values() for _, tm in p if tm >= floor})
    if rule == "shortest":
        length = floor
    elif rule == "longest":
        length = lengths[-1]
    else:

        def work(x: float) -> float:
            return sum(p[n - 1][1] for p in picks.values() if (n := _within(p, x)))

        length = max(lengths, key=lambda x: (work(x) / x if x else float("inf"), x))
    out = {}
    for w, p in picks.items():
        out[w] = tuple(lane_order([e for e, _ in p[: _within(p, length)]], order))
    return out
