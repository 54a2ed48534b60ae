"""The runtime: failure and slow-worker detection, precompiled failure variants, a train loop
through failures and slowdowns."""

from pjit_pipe.runtime.checkpoint import Checkpoints
from pjit_pipe.runtime.detector import (
    CollectiveTimeout,
    FailureDetector,
    InjectedFailures,
    LiveDevices,
    WorkerFailure,
)
from pjit_pipe.runtime.distributed import initialize_distributed, recovery_settings
from pjit_pipe.runtime.emulate_processes import emulate_processes
from pjit_pipe.runtime.emulation import emulate_in_process
from pjit_pipe.runtime.local_processes import PACKAGE_ROOT, free_port, local_process_env
from pjit_pipe.runtime.planned_stop import PlannedStop
from pjit_pipe.runtime.process_checkpoint import ProcessCheckpoints
from pjit_pipe.runtime.speed import (
    FACTORS,
    InjectedSlowdowns,
    SlowDetector,
    SpeedMonitor,
    device_probe,
    quantize,
)
from pjit_pipe.runtime.trainer import ResilientTrainer, TrainerEvent
from pjit_pipe.runtime.variants import Variant, Variants, check_cache_dir, use_disk_cache

__all__ = [
    "FACTORS",
    "PACKAGE_ROOT",
    "Checkpoints",
    "CollectiveTimeout",
    "FailureDetector",
    "InjectedFailures",
    "InjectedSlowdowns",
    "LiveDevices",
    "PlannedStop",
    "ProcessCheckpoints",
    "ResilientTrainer",
    "SlowDetector",
    "SpeedMonitor",
    "TrainerEvent",
    "Variant",
    "Variants",
    "WorkerFailure",
    "check_cache_dir",
    "device_probe",
    "emulate_in_process",
    "emulate_processes",
    "free_port",
    "initialize_distributed",
    "local_process_env",
    "quantize",
    "recovery_settings",
    "use_disk_cache",
]
