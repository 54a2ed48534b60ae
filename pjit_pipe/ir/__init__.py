"""The schedule IR: ops, per-worker programs, placement, text/JSON forms, validation,
costs, failure patterns and the execution engine."""

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import DeadlockError, Engine, TimedOp
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.memory import memory_trace, peak_memory
from pjit_pipe.ir.ops import BW, OPT, RECV, SEND, B, F, Kind, Op, Payload, W, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError, interleaved_layout, v_layout
from pjit_pipe.ir.serialize import from_json, from_text, to_json, to_text
from pjit_pipe.ir.validate import validate

__all__ = [
    "BW",
    "OPT",
    "RECV",
    "SEND",
    "B",
    "Costs",
    "DeadlockError",
    "Engine",
    "F",
    "FailurePattern",
    "Kind",
    "Op",
    "Payload",
    "Schedule",
    "ScheduleError",
    "TimedOp",
    "W",
    "Worker",
    "from_json",
    "from_text",
    "interleaved_layout",
    "memory_trace",
    "peak_memory",
    "to_json",
    "to_text",
    "v_layout",
    "validate",
]
