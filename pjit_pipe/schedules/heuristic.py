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
    # Memory in integer units of 1/(2v): F adds 2, B and W free 1 each.
    units = math.inf if limit is None else math.floor(limit * 2 * v + 1e-9)
    admit = 2 * v if policy.reserve else 2
    lat_f = [shape.latency(s - 1, s) if s else 0.0 for s in range(S)]
    lat_b = [shape.latency(s + 1, s) if s < S - 1 else 0.0 for s in range(S)]
    inf = math.inf
    act = [[0.0] * m] + [[inf] * m for _ in range(S - 1)]  # when F(s, j)'s input is there
    grad = [[inf] * m for _ in range(S)]  # when B(s, j)'s input is there
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
                    ok = mem[p] + 2 <= units
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
            mem[p] += 2
            if s == entry[p]:
                inflight[p] += 1
                if policy.reserve:
                    reserved[p] += 2 * (v - 1)
            elif policy.reserve:
                reserved[p] -= 2
            if s == S - 1:
                grad[s][j] = end
            else:
                act[s + 1][j] = end + lat_f[s + 1]
                if layout[s + 1] != p:
                    wake(heap, (act[s + 1][j], layout[s + 1]))
        elif kind is Kind.B:
            nb[s] += 1
            mem[p] -= 1
            pending_w[p].append((s, j))
            if s == entry[p]:
                inflight[p] -= 1
            if s:
                grad[s - 1][j] = end + lat_b[s - 1]
                if layout[s - 1] != p:
                    wake(heap, (grad[s - 1][j], layout[s - 1]))
        else:
            mem[p] -= 1
    if left:
        return None
    return Plan(tuple(map(tuple, progs)), finish(shape, first, free), policy)
