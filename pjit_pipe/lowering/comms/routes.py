"""Message routes: the ppermutes that carry one message channel.

A channel (activations, or gradients) moves messages along fixed (source,
dest) device pairs. One `lax.ppermute` carries a set of pairs in which no
device sends twice and none receives twice (a partial permutation), and the
tick body runs every ppermute of the plan, so each one is a collective per
tick. Grouping pairs by their (replica, position) shift on the worker grid
gives partial permutations for free, but a re-routed variant then uses up to
2D shifts per channel while no device talks to more than a few peers.

The fewest ppermutes that carry a set of pairs is the largest number of
peers one device sends to or receives from (König's theorem: a bipartite
graph's edges split into as many matchings as its largest degree). The
bytes a device sends per tick do not depend on the grouping (it sends one
message per pair it is the source of); the number of collectives does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

Pair = tuple[int, int]  # (source device, dest device)
Route = tuple[Pair, ...]  # the pairs of one ppermute, sorted


def degree(pairs: Iterable[Pair]) -> int:
    """The most peers one device sends to or receives from: the fewest routes."""
    pairs = set(pairs)
    sends = Counter(s for s, _ in pairs)
    gets = Counter(d for _, d in pairs)
    return max([*sends.values(), *gets.values()], default=0)


def fewest_routes(pairs: Iterable[Pair], grouping: Sequence[Iterable[Pair]] = ()) -> list[Route]:
    """`pairs` split into the fewest partial permutations.

    `grouping` (for example the pairs grouped by grid shift) is kept when it is
    already a split into partial permutations that few, so fault-free programs
    keep their one route per shift. Otherwise the pairs are edge-coloured: each
    pair takes a colour free at both its ends, after swapping two colours along
    an alternating path when none is (the path never reaches the pair's source,
    since the graph of senders and receivers is bipartite).
    """
    pairs = sorted(set(pairs))
    fewest = degree(pairs)
    groups = [tuple(sorted(set(g))) for g in grouping]
    if (
        len(groups) == fewest
        and sorted(p for g in groups for p in g) == pairs
        and all(degree(g) <= 1 for g in groups)
    ):
        return groups
    sent: dict[tuple[int, int], int] = {}  # (source, colour) -> dest
    got: dict[tuple[int, int], int] = {}  # (dest, colour) -> source
    for src, dst in pairs:
        a = next(c for c in range(fewest) if (src, c) not in sent)
        b = next(c for c in range(fewest) if (dst, c) not in got)
        if (dst, a) in got:
            _swap_along_path(sent, got, dst, a, b)
        sent[(src, a)] = dst
        got[(dst, a)] = src
    routes = [
        sorted((s, d) for (s, c), d in sent.items() if c == colour) for colour in range(fewest)
    ]
    return [tuple(r) for r in routes]


def _swap_along_path(
    sent: dict[tuple[int, int], int], got: dict[tuple[int, int], int], dst: int, a: int, b: int
) -> None:
    """Swap colours a and b on the path that leaves receiver `dst` by colour a and
    then alternates b, a, ...; afterwards a is free at `dst`."""
    path = []  # (source, dest, colour)
    node, at_receiver, colour = dst, True, a
    while True:
        if at_receiver:
            if (node, colour) not in got:
                break
            src = got[(node, colour)]
            path.append((src, node, colour))
            node = src
        else:
            if (node, colour) not in sent:
                break
            dest = sent[(node, colour)]
            path.append((node, dest, colour))
            node = dest
        at_receiver = not at_receiver
        colour = b if colour == a else a
    for s, d, c in path:
        del sent[(s, c)], got[(d, c)]
    for s, d, c in path:
        c = b if c == a else a
        sent[(s, c)] = d
        got[(d, c)] = s


def without_cycles(routes: Sequence[Route]) -> list[Route]:
    """`routes` with no ppermute whose pairs close a cycle: from each cycle (a ring
    shift) the wrap edge, the pair that leaves its highest device, moves to
    ppermutes of their own. A ring then travels as a forward shift and a separate
    wrap edge, as JAX's GPU performance notes advise: a cyclic collective-permute
    can deadlock or serialize in GPU runtimes' send/recv.

    The wrap edges of one route's cycles are a partial permutation, but those of
    different routes may share a device (the top of a cycle in two routes: a
    re-routed interleaved plan), so they are split into the fewest partial
    permutations again. Each wrap edge leaves its cycle's highest device for a
    lower one, so no set of them closes a cycle."""
    kept, wraps = [], []
    for route in routes:
        nxt = dict(route)
        wrap = set()
        seen: set[int] = set()
        for start in nxt:
            path, node = [], start
            while node in nxt and node not in seen:
                seen.add(node)
                path.append(node)
                node = nxt[node]
            if node in path:  # a cycle: path[path.index(node):]
                top = max(path[path.index(node) :])
                wrap.add((top, nxt[top]))
        kept.append(tuple(p for p in route if p not in wrap))
        wraps.extend(wrap)
    return [*kept, *fewest_routes(wraps)]


def channel_routes(grouping: Sequence[set[Pair]], pairwise: bool = False) -> list[Route]:
    """The ppermutes of one channel whose pairs `grouping` holds, grouped by grid
    shift: the fewest, without a cycle (`fewest_routes`, `without_cycles`).
    `pairwise`: one ppermute per pair, so a tick that runs only the ppermutes
    of its messages (`gated_sends(always=True)`) pairs each device with the
    devices it exchanges with and no other; a runtime of one controller per
    device then runs neighbour-synchronous (simulator/tick_sync.py)."""
    pairs = set().union(*grouping)
    if pairwise:
        return [(p,) for p in sorted(pairs)]
    return without_cycles(fewest_routes(pairs, grouping))


def gated_sends(
    act_used: np.ndarray, grad_used: np.ndarray, always: bool = False
) -> tuple[Any, np.ndarray]:
    """(the distinct sets of ppermutes ticks use, each tick's set) from the
    (devices, ticks, ppermutes) masks of the receives each channel makes.

    Gating costs a switch per tick (a conditional: on a GPU, a round trip to
    the host), so ticks are gated only when a channel has several ppermutes
    (re-routed variants, V layouts) and skipping the idle ones saves at least
    half of the ppermute executions; otherwise every tick runs every ppermute
    (one set, no switch)."""
    T = act_used.shape[1]
    every = (tuple(range(act_used.shape[2])), tuple(range(grad_used.shape[2])))
    if max(len(every[0]), len(every[1])) <= 1:
        return (every,), np.zeros(T, np.int32)
    used = [
        (
            tuple(int(i) for i in np.flatnonzero(act_used[:, t].any(0))),
            tuple(int(i) for i in np.flatnonzero(grad_used[:, t].any(0))),
        )
        for t in range(T)
    ]
    needed = sum(len(a) + len(g) for a, g in used)
    if not always and 2 * needed > T * (len(every[0]) + len(every[1])):
        return (every,), np.zeros(T, np.int32)
    sets = sorted(set(used))
    return tuple(sets), np.array([sets.index(u) for u in used], np.int32)
