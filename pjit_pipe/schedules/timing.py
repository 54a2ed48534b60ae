"""Fast pricing of one replica's per-position programs, for generators that compare many.

`pjit_pipe.simulator.simulate` is general (replicas, failures, SEND/RECV) and
takes a fifth of a second at P=32, m=128: too slow to call for every candidate
that `auto` weighs. This prices a fault-free replica under the same semantics
(an op starts when its worker is free and its inputs have arrived, `c` later
when they cross workers; OPT after the worker's work), so its figures equal
the simulator's; the tests check that they do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import BW, B, F, Kind, Op, W
from pjit_pipe.ir.schedule import ScheduleError


class Step(NamedTuple):
    """A compute op of one replica's program: kind (F, B, W or BW), virtual stage, microbatch."""

    kind: Kind
    stage: int
    mb: int


_MAKE = {Kind.F: F, Kind.B: B, Kind.W: W, Kind.BW: BW}


@dataclass(frozen=True)
class Shape:
    """Sizes, placement and per-virtual-stage op times of one pipeline replica."""

    stages: int
    chunks: int
    microbatches: int
    layout: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    c: float
    opt: float

    @classmethod
    def of(
        cls, stages: int, chunks: int, microbatches: int, layout: Sequence[int], costs: Costs
    ) -> Shape:
        """Per-chunk times: a position's F, B, W split evenly over its `chunks` chunks."""
        table = costs.per_stage(stages)
        f, b, w = (tuple(table[p][i] / chunks for p in layout) for i in range(3))
        return cls(stages, chunks, microbatches, tuple(layout), f, b, w, costs.c, costs.opt)

    @property
    def num_virtual(self) -> int:
        return self.stages * self.chunks

    def duration(self, step: Step) -> float:
        s = step.stage
        if step.kind is Kind.F:
            return self.f[s]
        if step.kind is Kind.B:
            return self.b[s]
        if step.kind is Kind.W:
            return self.w[s]
        return self.b[s] + self.w[s]

    def latency(self, src: int, dst: int) -> float:
        """Transfer time of a tensor from virtual stage `src` to `dst`."""
        return 0.0 if self.layout[src] == self.layout[dst] else self.c

    def held(self, position: int) -> list[int]:
        return [s for s, p in enumerate(self.layout) if p == position]


class Timing(NamedTuple):
    """Makespan and span of one iteration (docs/design.md section 3)."""

    makespan: float
    span: float

    def score(self, objective: str) -> tuple[float, float]:
        """Sort key: the objective first, the other figure as tie-break."""
        return (self.makespan, self.span) if objective == "makespan" else (self.span, self.makespan)


def finish(shape: Shape, first: Sequence[float], last: Sequence[float]) -> Timing:
    """Timing from each position's first start and last compute end (OPTs are appended)."""
    ends = [e + shape.chunks * shape.opt for e in last]
    return Timing(max(ends) - min(first), max(e - s for s, e in zip(first, ends, strict=True)))


def evaluate(shape: Shape, programs: Sequence[Sequence[Step]]) -> Timing:
    """Price the per-position `programs` (OPT excluded); ScheduleError if they deadlock."""
    S, m, P = shape.num_virtual, shape.microbatches, len(programs)
    # ends[0][s][j]: end of F(s, j); ends[1][s][j]: end of B or BW(s, j).
    ends: list[list[list[float | None]]] = [[[None] * m for _ in range(S)] for _ in range(2)]
    waiting: dict[tuple[int, int, int], list[int]] = {}
    ptr, free, first = [0] * P, [0.0] * P, [0.0] * P
    todo = list(range(P))
    while todo:
        p = todo.pop()
        prog = programs[p]
        while ptr[p] < len(prog):
            kind, s, j = step = prog[ptr[p]]
            if kind is Kind.F:
                need, lat = ((0, s - 1, j), shape.latency(s - 1, s)) if s else (None, 0.0)
            elif kind is Kind.W:
                need, lat = (1, s, j), 0.0
            elif s == S - 1:
                need, lat = (0, s, j), 0.0
            else:
                need, lat = (1, s + 1, j), shape.latency(s + 1, s)
            ready = 0.0
            if need is not None:
                ready = ends[need[0]][need[1]][need[2]]
                if ready is None:
                    waiting.setdefault(need, []).append(p)
                    break
            start = max(free[p], ready + lat)
            if ptr[p] == 0:
                first[p] = start
            free[p] = start + shape.duration(step)
            if kind is not Kind.W:
                made = 0 if kind is Kind.F else 1
                ends[made][s][j] = free[p]
                todo.extend(waiting.pop((made, s, j), ()))
            ptr[p] += 1
    stuck = [p for p, prog in enumerate(programs) if ptr[p] < len(prog)]
    if stuck:
        p = stuck[0]
        raise ScheduleError(f"programs deadlock: position {p} waits at {programs[p][ptr[p]]}")
    return finish(shape, first, free)


def to_ops(steps: Sequence[Step], replica: int) -> list[Op]:
    """IR ops of one position's program (OPT excluded) for microbatches of `replica`."""
    return [_MAKE[k](s, j, replica) for k, s, j in steps]
