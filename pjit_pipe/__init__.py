"""pjit_pipe: a pipeline-parallel training compiler for JAX.

The public API is the names below. Importing the package imports no JAX: the
`pjit-pipe` command must set XLA_FLAGS (how many CPU devices) before JAX
starts, so each name is loaded from its module on first use (PEP 562), while
type checkers and IDEs see the same names through the `TYPE_CHECKING` imports.
The errors import nothing heavy and are loaded at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pjit_pipe.errors import (
    BatchError,
    CheckpointError,
    CutError,
    FailurePlanError,
    JaxprError,
    LossFnError,
    MeshError,
    OptimizerError,
    OptionError,
    PjitPipeError,
    PlotError,
    RngError,
    ScheduleError,
    SplitError,
    StateError,
)

if TYPE_CHECKING:
    from pjit_pipe.frontend.cutter.cut import StageCut
    from pjit_pipe.frontend.cutter.trace import boundary
    from pjit_pipe.frontend.mesh import make_mesh
    from pjit_pipe.frontend.options import PipelineOptions
    from pjit_pipe.frontend.pipeline import pipeline
    from pjit_pipe.frontend.pipelined import Pipelined
    from pjit_pipe.frontend.planning.live_plan import plan_pipeline
    from pjit_pipe.frontend.state import TrainState
    from pjit_pipe.frontend.train_step import TrainStep
    from pjit_pipe.ir.costs import Costs
    from pjit_pipe.ir.schedule import Schedule
    from pjit_pipe.runtime.checkpoint import Checkpoints
    from pjit_pipe.runtime.detector import InjectedFailures, LiveDevices
    from pjit_pipe.runtime.distributed import initialize_distributed
    from pjit_pipe.runtime.trainer import ResilientTrainer
    from pjit_pipe.schedules import make_schedule

# Lazily loaded names -> the module that defines them (keep in step with the imports above).
_LAZY: dict[str, str] = {
    "Checkpoints": "pjit_pipe.runtime.checkpoint",
    "Costs": "pjit_pipe.ir.costs",
    "InjectedFailures": "pjit_pipe.runtime.detector",
    "LiveDevices": "pjit_pipe.runtime.detector",
    "PipelineOptions": "pjit_pipe.frontend.options",
    "Pipelined": "pjit_pipe.frontend.pipelined",
    "ResilientTrainer": "pjit_pipe.runtime.trainer",
    "Schedule": "pjit_pipe.ir.schedule",
    "StageCut": "pjit_pipe.frontend.cutter.cut",
    "TrainState": "pjit_pipe.frontend.state",
    "TrainStep": "pjit_pipe.frontend.train_step",
    "boundary": "pjit_pipe.frontend.cutter.trace",
    "initialize_distributed": "pjit_pipe.runtime.distributed",
    "make_mesh": "pjit_pipe.frontend.mesh",
    "make_schedule": "pjit_pipe.schedules",
    "pipeline": "pjit_pipe.frontend.pipeline",
    "plan_pipeline": "pjit_pipe.frontend.planning.live_plan",
}

__all__ = [
    "BatchError",
    "CheckpointError",
    "Checkpoints",
    "Costs",
    "CutError",
    "FailurePlanError",
    "InjectedFailures",
    "JaxprError",
    "LiveDevices",
    "LossFnError",
    "MeshError",
    "OptimizerError",
    "OptionError",
    "PipelineOptions",
    "Pipelined",
    "PjitPipeError",
    "PlotError",
    "ResilientTrainer",
    "RngError",
    "Schedule",
    "ScheduleError",
    "SplitError",
    "StageCut",
    "StateError",
    "TrainState",
    "TrainStep",
    "boundary",
    "initialize_distributed",
    "make_mesh",
    "make_schedule",
    "pipeline",
    "plan_pipeline",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pjit_pipe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
