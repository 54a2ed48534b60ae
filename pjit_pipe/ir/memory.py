"""Activation memory of a schedule, in units of one microbatch's activations on one stage.

F adds one chunk's activations (1/v of a stage), B frees half of them, W the
other half, BW all. Memory depends only on each worker's program order, not on
timing, so it is exact. Internally counted in integer units of 1/(2v), "half
chunks": the one place that states those units is this module; every list
scheduler and pass that tracks memory uses `MEMORY_DELTA` and `limit_units`.
"""

from __future__ import annotations

import math

from pjit_pipe.ir.ops import Kind, Worker
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
