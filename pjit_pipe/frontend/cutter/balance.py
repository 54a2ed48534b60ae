"""Split a chain of segment costs into contiguous stages with the smallest bottleneck.

The pipeline runs at the pace of its slowest stage, so the cut minimises the
largest stage cost; among equally good cuts it prefers the one whose stages
are most even (smallest sum of squared costs).

A segment may weigh several things at once, (FLOPs, parameters): one SPMD
program pads every device's parameter rows to the largest stage's, so memory
has a bottleneck of its own. Each measure is then taken relative to its mean
stage (its total / stages) and a stage costs its largest relative measure:
the cut minimises the worse of the two imbalances instead of one alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from pjit_pipe.errors import CutError


def _relative(costs: Sequence[Sequence[float]], stages: int) -> list[list[float]]:
    """Each segment's measures as shares of that measure's mean stage."""
    totals = [sum(c[i] for c in costs) for i in range(len(costs[0]))]
    return [[stages * x / t if t else 0.0 for x, t in zip(c, totals, strict=True)] for c in costs]


def group_costs(
    costs: Sequence[float] | Sequence[Sequence[float]], starts: Sequence[int]
) -> list[float]:
    """Each stage's cost under the cut `starts` (as `balance` weighs it)."""
    ends = [*starts[1:], len(costs)]
    if not costs or isinstance(costs[0], int | float):
        return [float(sum(costs[a:b])) for a, b in zip(starts, ends, strict=True)]
    shares = _relative(costs, len(starts))
    return [
        max(sum(col) for col in zip(*shares[a:b], strict=True))
        for a, b in zip(starts, ends, strict=True)
    ]


def balance(costs: Sequence[float] | Sequence[Sequence[float]], stages: int) -> list[int]:
    """Start index of each of `stages` non-empty contiguous groups of `costs` (one
    float per segment, or one vector of measures per segment: module docstring)."""
    n = len(costs)
    if stages < 1:
        raise CutError(f"stages must be >= 1, got {stages}")
    if n < stages:
        raise CutError(f"cannot cut {n} segments into {stages} stages")
    vectors = (
        [[c] for c in costs] if isinstance(costs[0], int | float) else _relative(costs, stages)
    )
    prefix = [[0.0] * len(vectors[0])]
    for c in vectors:
        prefix.append([p + x for p, x in zip(prefix[-1], c, strict=True)])

    def cost(j: int, i: int) -> float:  # segments j..i-1 as one stage
        return max(b - a for a, b in zip(prefix[j], prefix[i], strict=True))

    # best[k][i]: (bottleneck, sum of squares, previous start) for the first i
    # segments in k groups.
    inf = (float("inf"), float("inf"), -1)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0, -1)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                neck, squares, _ = best[k - 1][j]
                c = cost(j, i)
                candidate = (max(neck, c), squares + c * c, j)
                if candidate[:2] < best[k][i][:2]:
                    best[k][i] = candidate
    starts, i = [], n
    for k in range(stages, 0, -1):
        j = best[k][i][2]
        starts.append(j)
        i = j
    return starts[::-1]
