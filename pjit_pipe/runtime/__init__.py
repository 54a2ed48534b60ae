"""The runtime: failure detection, precompiled failure variants, a train loop through failures."""

from pjit_pipe.runtime.checkpoint import Checkpoints
from pjit_pipe.runtime.detector import FailureDetector, InjectedFailures, LiveDevices, WorkerFailure
from pjit_pipe.runtime.emulate_processes import emulate_processes
from pjit_pipe.runtime.emulation import emulate_in_process
from pjit_pipe.runtime.trainer import ResilientTrainer, TrainerEvent
from pjit_pipe.runtime.variants import Variant, Variants, check_cache_dir, use_disk_cache

__all__ = [
    "Checkpoints",
    "FailureDetector",
    "InjectedFailures",
    "LiveDevices",
    "ResilientTrainer",
    "TrainerEvent",
    "Variant",
    "Variants",
    "WorkerFailure",
    "check_cache_dir",
    "emulate_in_process",
    "emulate_processes",
    "use_disk_cache",
]
