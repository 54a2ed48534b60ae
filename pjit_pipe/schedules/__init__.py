"""Schedule generators: build an IR schedule from (kind, P, m, v, costs, memory limit).

`make_schedule` is the one entry point the CLI, the frontend and the benchmarks use.
"""

from __future__ import annotations

from collections.abc import Callable

from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.schedules.classic import gpipe, one_f_one_b
from pjit_pipe.simulator.costs import Costs

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "auto")

_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": lambda P, m, v, costs, limit, D: gpipe(P, m, D),
    "1f1b": lambda P, m, v, costs, limit, D: one_f_one_b(P, m, D),
}


def make_schedule(
    kind: str,
    stages: int,
    microbatches: int,
    chunks: int = 1,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    replicas: int = 1,
) -> Schedule:
    """Generate a fault-free schedule of `kind` (one of KINDS).

    Raises ScheduleError, naming the parameter, for requests no schedule of
    that kind can meet; never returns a silently different schedule.
    """
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    if kind not in _GENERATORS:
        raise ScheduleError(f"schedule kind {kind!r} is not implemented yet")
    return _GENERATORS[kind](stages, microbatches, chunks, costs or Costs(), mem_limit, replicas)


__all__ = ["KINDS", "make_schedule"]
