"""Greedy list scheduling in simulated time: the fast engine behind `auto`.

Whenever a worker is free it picks its next op from what has arrived: a B
first (it is on the critical path: the previous stage waits for it), then an F
if memory and the warm-up cap allow, else a W, which can wait, to fill the
bubble or to free memory. Ops start exactly when their worker is free and their
inputs have arrived (`c` later across workers), so the engine's times are the
simulator's. One run takes tens of milliseconds at P=32, m=128; `auto` runs it
under several policies and keeps the best.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

from pjit_pipe.ir.engine import consumers, makes, needs
from pjit_pipe.ir.memory import MEMORY_DELTA, limit_units, units_per_microbatch
from pjit_pipe.ir.ops import Kind
from pjit_pipe.schedules.timing import Shape, Step, Timing, finish

Fill = Literal["eager", "fit"]


@dataclass(frozen=True)
class Policy:
    """Knobs of one greedy run.

    caps: position p keeps at most caps[p] microbatches in flight (F of its
        first chunk done, B of it not yet); None: memory alone caps. 1F1B's
        caps are P - p; larger caps fill the start-up bubble with F.
    fill: with nothing but W to run, "eager" runs it at once; "fit" runs it
        only if it ends before the next known B or admissible F arrives, and
        otherwise waits for that op (a W never delays the critical path).
    reserve: admit a microbatch on a position only if memory also holds its
        later chunks there (never deadlocks with several chunks per worker).
    """

    caps: tuple[int, ...] | None = None
    fill: Fill = "eager"
    reserve: bool = True


@dataclass(frozen=True)
class Plan:
    """A greedy run's per-position programs and their timing."""

    programs: tuple[tuple[Step, ...], ...]
    timing: Timing
    policy: Policy


def greedy(shape: Shape, limit: float | None, policy: Policy) -> Plan | None:
    """Run the list scheduler; None if the policy deadlocks (only without `reserve`).

    `limit` bounds each worker's activation memory (units: docs/design.md section 3;
    None: unbounded).
    """
    P, v, m = shape.stages, shape.chunks, shape.microbatches
    S = shape.num_virtual
    layout = shape.layout
    held = [shape.held(p) for p in range(P)]
    entry = [h[0] for h in held]  # the chunk a microbatch visits first on each position
    cap = [m] * P if policy.caps is None else [max(1, c) for c in policy.caps]
    # Memory in half-chunk units (`pjit_pipe.ir.memory`): F adds `grow`, B and W free the rest.
    grow = MEMORY_DELTA[Kind.F]
    units = limit_units(limit, v)
    admit = units_per_microbatch(v) if policy.reserve else MEMORY_DELTA[Kind.F]
    inf = math.inf
    # The engine's dependency rule, as this scheduler uses it: what each F/B waits for
    # (`needs`) and which F/B an op's output feeds, with its transfer time (`consumers`;
    # W waits in its worker's queue instead).
    missing = {k: [[len(needs(k, s, S - 1))] * m for s in range(S)] for k in (Kind.F, Kind.B)}
    arrived = {k: [[0.0] * m for _ in range(S)] for k in (Kind.F, Kind.B)}
    act = [[0.0 if not missing[Kind.F][s][0] else inf] * m for s in range(S)]
    grad = [[inf] * m for _ in range(S)]
    ready = {Kind.F: act, Kind.B: grad}  # ready[k][s][j]: when op (k, s, j)'s inputs are there
    # feeds[kind][s]: per consumer, its rows (by microbatch) of missing inputs, arrival
    # and readiness, the transfer time, and its position.
    feeds = {
        k: [
            [
                (missing[ck][cs], arrived[ck][cs], ready[ck][cs], shape.latency(s, cs), layout[cs])
                for ck, cs in consumers(makes(k), s, S - 1)
                if ck in (Kind.F, Kind.B)
            ]
            for s in range(S)
        ]
        for k in (Kind.F, Kind.B)
    }
    nf, nb = [0] * S, [0] * S
    pending_w: list[deque] = [deque() for _ in range(P)]
    mem, reserved, inflight = [0] * P, [0] * P, [0] * P
    free = [0.0] * P
    first = [inf] * P
    progs: list[list[Step]] = [[] for _ in range(P)]
    heap = [(0.0, p) for p in range(P)]
    wake, pop = heapq.heappush, heapq.heappop
    dur = {Kind.F: shape.f, Kind.B: shape.b, Kind.W: shape.w}
    fit = policy.fill == "fit"
    left = 3 * S * m

    while heap:
        t, p = pop(heap)
        if t < free[p]:
            continue
        step = None
        # B: the one whose gradient came first; the deeper stage on ties.
        best = inf
        for s in held[p]:
            j = nb[s]
            if j < m and grad[s][j] <= t and grad[s][j] <= best:
                best, step = grad[s][j], Step(Kind.B, s, j)
        if step is None:
            fs = None  # F: deeper chunks of admitted microbatches first, then admit a new one
            nxt = inf
            for s in reversed(held[p]):
                j = nf[s]
                if j >= m:
                    continue
                if s == entry[p]:
                    ok = inflight[p] < cap[p] and mem[p] + reserved[p] + admit <= units
                else:
                    ok = mem[p] + grow <= units
                if not ok:
                    continue
                if act[s][j] <= t:
                    fs = s
                    break
                nxt = min(nxt, act[s][j])
            if fs is not None:
                step = Step(Kind.F, fs, nf[fs])
            elif pending_w[p]:
                if fit:
                    for s in held[p]:
                        if nb[s] < m:
                            nxt = min(nxt, grad[s][nb[s]])
                ws, wj = pending_w[p][0]
                if not fit or t + shape.w[ws] <= nxt:
                    step = Step(Kind.W, ws, wj)
                    pending_w[p].popleft()
                elif nxt < inf:
                    wake(heap, (nxt, p))
        if step is None:
            continue
        kind, s, j = step
        end = t + dur[kind][s]
        progs[p].append(step)
        first[p] = min(first[p], t)
        free[p] = end
        left -= 1
        wake(heap, (end, p))
        if kind is Kind.F:
            nf[s] += 1
            mem[p] += grow
            if s == entry[p]:
                inflight[p] += 1
                if policy.reserve:
                    reserved[p] += admit - grow
            elif policy.reserve:
                reserved[p] -= grow
        elif kind is Kind.B:
            nb[s] += 1
            mem[p] += MEMORY_DELTA[Kind.B]
            pending_w[p].append((s, j))
            if s == entry[p]:
                inflight[p] -= 1
        else:
            mem[p] += MEMORY_DELTA[Kind.W]
            continue
        for miss, at, rdy, lat, q in feeds[kind][s]:
            if end + lat > at[j]:
                at[j] = end + lat
            miss[j] -= 1
            if not miss[j]:
                rdy[j] = at[j]
                if q != p:
                    wake(heap, (at[j], q))
    if left:
        return None
    return Plan(tuple(map(tuple, progs)), finish(shape, first, free), policy)
