"""The runtime: failure detection, precompiled failure variants, a train loop through failures."""

from pjit_pipe.runtime.detector import FailureDetector, InjectedFailures, LiveDevices, WorkerFailure
from pjit_pipe.runtime.trainer import Event, ResilientTrainer
from pjit_pipe.runtime.variants import Variant, Variants

__all__ = [
    "Event",
    "FailureDetector",
    "InjectedFailures",
    "LiveDevices",
    "ResilientTrainer",
    "Variant",
    "Variants",
    "WorkerFailure",
]
