"""pjit_pipe: a pipeline-parallel training compiler for JAX."""

from __future__ import annotations

import importlib
from typing import Any

# Public names are loaded on first use: importing the package (e.g. for the CLI)
# must not import JAX, so the CLI can still set XLA_FLAGS first.
_EXPORTS = {
    "Pipelined": "pjit_pipe.frontend",
    "StageCut": "pjit_pipe.frontend",
    "TrainState": "pjit_pipe.frontend",
    "TrainStep": "pjit_pipe.frontend",
    "boundary": "pjit_pipe.frontend",
    "make_mesh": "pjit_pipe.frontend",
    "pipeline": "pjit_pipe.frontend",
    "Checkpoints": "pjit_pipe.runtime.checkpoint",
    "InjectedFailures": "pjit_pipe.runtime",
    "LiveDevices": "pjit_pipe.runtime",
    "ResilientTrainer": "pjit_pipe.runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pjit_pipe' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
