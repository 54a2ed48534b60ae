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

from pjit_pipe.ir.ops import BW, B, F, Kind, Op, W
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.simulator.costs import Costs


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
    """Makespan and span of one iteration (DESIGN.md section 3)."""

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
    S, m = shape.num_virtual, shape.microbatches
    act_end: list[list[float | None]] = [[None] * m for _ in range(S)]
    grad_end: list[list[float | None]] = [[None] * m for _ in range(S)]
    ptr = [0] * len(programs)
    free = [0.0] * len(programs)
    first = [None] * len(programs)
    progress = True
    while progress:
        progress = False
        for p, prog in enumerate(programs):
            while ptr[p] < len(prog):
                kind, s, j = step = prog[ptr[p]]
                if kind is Kind.F:
                    ready = 0.0 if s == 0 else act_end[s - 1][j]
                    lat = 0.0 if s == 0 else shape.latency(s - 1, s)
                elif kind is Kind.W:
                    ready, lat = grad_end[s][j], 0.0
                elif s == S - 1:
                    ready, lat = act_end[s][j], 0.0
                else:
                    ready, lat = grad_end[s + 1][j], shape.latency(s + 1, s)
                if ready is None:
                    break
                start = max(free[p], ready + lat)
                free[p] = start + shape.duration(step)
                if first[p] is None:
                    first[p] = start
                if kind is Kind.F:
                    act_end[s][j] = free[p]
                elif kind is not Kind.W:
                    grad_end[s][j] = free[p]
                ptr[p] += 1
                progress = True
    stuck = [p for p, prog in enumerate(programs) if ptr[p] < len(prog)]
    if stuck:
        p = stuck[0]
        raise ScheduleError(f"programs deadlock: position {p} waits at {programs[p][ptr[p]]}")
    return finish(shape, [f or 0.0 for f in first], free)


def to_ops(steps: Sequence[Step], replica: int) -> list[Op]:
    """IR ops of one position's program (OPT excluded) for microbatches of `replica`."""
    return [_MAKE[k](s, j, replica) for k, s, j in steps]
