"""Shared checks and assembly for schedule generators."""

from __future__ import annotations

from collections.abc import Callable

from pjit_pipe.ir.ops import OPT, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError, interleaved_layout


def check_positive(**values: int) -> None:
    """Reject non-positive sizes with the parameter's name."""
    for name, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {v!r}")


def with_opt(stage_ops: list[Op], held: list[int], replica: int) -> list[Op]:
    """Append the optimizer step of every held stage after the iteration's work."""
    return [*stage_ops, *(OPT(s, replica) for s in held)]


def replicated(
    kind: str,
    stages: int,
    microbatches: int,
    replicas: int,
    program_of: Callable[[int, int], list[Op]],
    chunks: int = 1,
    layout: tuple[int, ...] | None = None,
) -> Schedule:
    """Build a fault-free schedule whose replicas all run the same per-position program.

    `program_of(position, replica)` returns the position's ops (OPT excluded).
    """
    layout = layout or interleaved_layout(stages, chunks)
    held = {p: [s for s, q in enumerate(layout) if q == p] for p in range(stages)}
    programs = {
        Worker(r, p): with_opt(program_of(p, r), held[p], r)
        for r in range(replicas)
        for p in range(stages)
    }
    return Schedule(
        stages=stages,
        chunks=chunks,
        microbatches=microbatches,
        replicas=replicas,
        layout=layout,
        programs=programs,
        kind=kind,
    )
