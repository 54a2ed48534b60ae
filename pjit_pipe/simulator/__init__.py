"""The simulator: prices schedules under a cost model (`pjit_pipe.ir.Costs`) and draws them."""

from pjit_pipe.simulator.bounds import (
    fill_bound,
    least_largest_load,
    lockstep_lower_bound,
    lower_bound,
    slow_bound,
)
from pjit_pipe.simulator.chrome_trace import chrome_trace
from pjit_pipe.simulator.simulate import (
    STEADY_ITERATIONS,
    SimResult,
    TickPricer,
    best_of,
    packed_time,
    simulate,
    steady_period,
)
from pjit_pipe.simulator.tick_sync import SYNCS, PlannedOp, TickTimeline, WorkerTick, check_sync

__all__ = [
    "STEADY_ITERATIONS",
    "SUFFIXES",
    "SYNCS",
    "PlannedOp",
    "SimResult",
    "TickPricer",
    "TickTimeline",
    "WorkerTick",
    "best_of",
    "check_sync",
    "chrome_trace",
    "draw_gantt",
    "fill_bound",
    "gantt",
    "least_largest_load",
    "lockstep_lower_bound",
    "lower_bound",
    "packed_time",
    "simulate",
    "slow_bound",
    "steady_period",
    "tick_gantt",
]

# Drawing needs matplotlib: loaded on first use (PEP 562),
# so that pricing a schedule does not import it.
_LAZY = {
    "SUFFIXES": "pjit_pipe.simulator.charts",
    "draw_gantt": "pjit_pipe.simulator.charts",
    "gantt": "pjit_pipe.simulator.charts",
    "tick_gantt": "pjit_pipe.simulator.charts",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
