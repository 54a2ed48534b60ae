"""Activation memory of a schedule, in units of one microbatch's activations on one stage.

F adds one chunk's activations (1/v of a stage), B frees half of them, W the
other half, BW all. Memory depends only on each worker's program order, not on
timing, so it is exact. Internally counted in integer units of 1/(2v), "half
chunks": the one place that states those units is this module; every list
scheduler and pass that tracks memory uses `MEMORY_DELTA` and `limit_units`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule

# Change of a worker's activation memory when it runs an op, in half-chunk units.
MEMORY_DELTA = {Kind.F: 2, Kind.B: -1, Kind.W: -1, Kind.BW: -2}


def units_per_microbatch(chunks: int) -> int:
    """Half-chunk units in one microbatch's activations on one stage (all its chunks)."""
    return 2 * chunks


def limit_units(limit: float | None, chunks: int) -> float:
    """A memory limit in docs/design.md units as a whole number of half-chunk units (inf: none)."""
    if limit is None or math.isinf(limit):
        return math.inf
    return math.floor(limit * units_per_microbatch(chunks) + 1e-9)


def memory_trace(schedule: Schedule, worker: Worker) -> list[float]:
    """In-flight activation memory after each op of `worker`'s program."""
    scale = units_per_microbatch(schedule.chunks)
    total, out = 0, []
    for op in schedule.program(worker):
        total += MEMORY_DELTA.get(op.kind, 0)
        out.append(total / scale)
    return out


def peak_memory(schedule: Schedule) -> dict[Worker, float]:
    """Each worker's peak in-flight activation memory (0 for failed workers)."""
    return {w: max(memory_trace(schedule, w), default=0.0) for w in schedule.workers}


def largest_peak(schedule: Schedule) -> float:
    """The largest worker's peak: what one SPMD program sizes every device's residual store for."""
    return max(peak_memory(schedule).values(), default=0.0)


def split_stages(schedule: Schedule) -> frozenset[int]:
    """The virtual stages the lowering runs with a split backward: those the schedule
    runs as separate B and W, except the first (its B is empty: its W is the whole
    backward)."""
    return frozenset(
        op.stage for _, _, op in schedule.ops() if op.kind in (Kind.B, Kind.W) and op.stage > 0
    )


def pool_delta(op: Op, split: frozenset[int]) -> tuple[int, int]:
    """Change of a worker's (B-pool, W-pool) rows when it runs `op`: the lowering's two
    residual pools (lowering/compute/stages.py). A split stage's F takes a B-pool row that
    its B frees; every F takes a W-pool row that the stage's W or BW frees."""
    if op.kind is Kind.F:
        return (1 if op.stage in split else 0), 1
    if op.kind is Kind.B:
        return (-1 if op.stage in split else 0), 0
    if op.kind in (Kind.W, Kind.BW):
        return 0, -1
    return 0, 0


@dataclass(frozen=True)
class MemoryBound:
    """What a packed tick table may hold on each worker, counted op by op in each
    tick's lane order: activations in half-chunk units, and rows of each of the
    lowering's residual pools.

    Units alone do not bound the compiled program: F takes a row of each pool,
    and B and W free them apart, so a table can keep the units of the schedule
    while one pool holds a row more (more F's ahead of B's, fewer W's behind),
    and every device's pool is sized for the busiest. `of(schedule, None)`
    bounds each pool by the schedule's own peak too."""

    units: float  # half-chunk units (`limit_units`); inf: unbounded
    rows: tuple[float, float] = (math.inf, math.inf)  # (B-pool rows, W-pool rows)
    split: frozenset[int] = frozenset()  # `split_stages` of the schedule

    @classmethod
    def of(cls, schedule: Schedule, mem_limit: float | None) -> MemoryBound:
        """mem_limit None: the schedule's own peak, in units and pool by pool (the
        largest worker's, running its program in order): the packed program then
        holds no more than the unpacked one. A number: that many docs/design.md
        units, pools unbounded."""
        split = split_stages(schedule)
        if mem_limit is not None:
            return cls(limit_units(mem_limit, schedule.chunks), split=split)
        peaks = [0, 0]
        for w in schedule.workers:
            rows = [0, 0]
            for op in schedule.program(w):
                rows = [r + d for r, d in zip(rows, pool_delta(op, split), strict=True)]
                peaks = [max(p, r) for p, r in zip(peaks, rows, strict=True)]
        units = limit_units(largest_peak(schedule), schedule.chunks)
        return cls(units, (float(peaks[0]), float(peaks[1])), split)

    @property
    def caps(self) -> tuple[float, float, float]:
        """The bound on (units, B-pool rows, W-pool rows)."""
        return (self.units, *self.rows)

    def delta(self, op: Op) -> tuple[int, int, int]:
        """Change of a worker's (units, B-pool rows, W-pool rows) when it runs `op`."""
        return (MEMORY_DELTA.get(op.kind, 0), *pool_delta(op, self.split))

    def admits(self, held: tuple[int, int, int]) -> bool:
        """Whether a worker may hold `held` (units, B-pool rows, W-pool rows)."""
        return held[0] <= self.units and held[1] <= self.rows[0] and held[2] <= self.rows[1]


@dataclass(frozen=True)
class StoredBytes:
    """What one microbatch of one virtual stage really stores, and which op frees it.

    `MEMORY_DELTA` prices every stage alike: F stores one unit, B and W free
    half each. A split backward (lowering/compute/stage_backward.py) stores more, and
    not in halves: its vjp residuals live from F to B (`until_b`), W's data
    operands from F to W (`until_w`), and the cotangents B stores for W from B
    to W (`from_b`); in real models B stores more than it frees. Any unit will
    do (bytes, or the stage's fused residuals); `DESIGN_UNITS` is
    `MEMORY_DELTA`'s pricing. A stage whose B is empty (the first) stores
    everything until W.
    """

    until_b: float
    until_w: float
    from_b: float = 0.0

    def delta(self, kind: Kind) -> float:
        """Change of the stage's stored memory when it runs an op of `kind`."""
        return {
            Kind.F: self.until_b + self.until_w,
            Kind.B: self.from_b - self.until_b,
            Kind.W: -(self.until_w + self.from_b),
            Kind.BW: -(self.until_b + self.until_w),
        }.get(kind, 0.0)


DESIGN_UNITS = StoredBytes(until_b=0.5, until_w=0.5)


def stored_trace(
    schedule: Schedule, worker: Worker, stored: Mapping[int, StoredBytes]
) -> list[float]:
    """`worker`'s stored memory after each op of its program, each virtual stage s
    priced by `stored[s]` (DESIGN_UNITS everywhere gives `memory_trace` times v)."""
    total, out = 0.0, []
    for op in schedule.program(worker):
        total += stored[op.stage].delta(op.kind)
        out.append(total)
    return out


def stored_peak(schedule: Schedule, stored: Mapping[int, StoredBytes]) -> dict[Worker, float]:
    """Each worker's peak of `stored_trace` (0 for failed workers)."""
    return {w: max(stored_trace(schedule, w, stored), default=0.0) for w in schedule.workers}
