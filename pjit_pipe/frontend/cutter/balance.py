"""Split a chain of segment costs into contiguous stages with the smallest bottleneck.

The pipeline runs at the pace of its slowest stage, so the cut minimises the
largest stage cost; among equally good cuts it prefers the one whose stages
are most even (smallest sum of squared costs).
"""

from __future__ import annotations

from collections.abc import Sequence

from pjit_pipe.errors import CutError


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Start index of each of `stages` non-empty contiguous groups of `costs`."""
    n = len(costs)
    if stages < 1:
        raise CutError(f"stages must be >= 1, got {stages}")
    if n < stages:
        raise CutError(f"cannot cut {n} segments into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    # best[k][i]: (bottleneck, sum of squares, previous start) for the first i
    # segments in k groups.
    inf = (float("inf"), float("inf"), -1)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0, -1)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                neck, squares, _ = best[k - 1][j]
                cost = prefix[i] - prefix[j]
                candidate = (max(neck, cost), squares + cost * cost, j)
                if candidate[:2] < best[k][i][:2]:
                    best[k][i] = candidate
    starts, i = [], n
    for k in range(stages, 0, -1):
        j = best[k][i][2]
        starts.append(j)
        i = j
    return starts[::-1]
