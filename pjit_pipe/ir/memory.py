"""Activation memory of a schedule, in units of one microbatch's activations on one stage.

F adds one chunk's activations (1/v of a stage), B frees half of them, W the
other half, BW all. Memory depends only on each worker's program order, not on
timing, so it is exact. Internally counted in integer units of 1/(2v).
"""

from __future__ import annotations

from pjit_pipe.ir.ops import Kind, Worker
from pjit_pipe.ir.schedule import Schedule

_DELTA = {Kind.F: 2, Kind.B: -1, Kind.W: -1, Kind.BW: -2}


def memory_trace(schedule: Schedule, worker: Worker) -> list[float]:
    """In-flight activation memory after each op of `worker`'s program."""
    scale = 2 * schedule.chunks
    total, out = 0, []
    for op in schedule.program(worker):
        total += _DELTA.get(op.kind, 0)
        out.append(total / scale)
    return out


def peak_memory(schedule: Schedule) -> dict[Worker, float]:
    """Each worker's peak in-flight activation memory (0 for failed workers)."""
    return {w: max(memory_trace(schedule, w), default=0.0) for w in schedule.workers}
