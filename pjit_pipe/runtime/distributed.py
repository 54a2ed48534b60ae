"""Joining a multi-process job (one process per host) with what recovery from a dead process needs.

`initialize_distributed` wraps `jax.distributed.initialize`, so on SLURM, Open
MPI and Kubernetes (JAX's cluster auto-detection) it needs no arguments, and
sets, before the backend starts, the settings without which a process that
dies takes the others down or hangs them:

- `jax_enable_recoverability`: by default JAX's coordination service tells
  every process to terminate about a heartbeat after one dies (fate sharing);
  with it the survivors go on and `multihost_utils.live_devices` tells them
  who is gone.
- the heartbeat timeout (`heartbeat_timeout_s`, JAX's default 100 s): how long
  the coordination service waits for a silent process before it counts it as
  dead. It bounds the time from a kill to its detection; too short a timeout
  counts a process that is only slow (a long compile holds no heartbeat back,
  a stopped process does) as dead.
- on CPU, gloo collectives (the only ones that cross processes) and XLA:CPU's
  collective timeout (`--xla_cpu_collective_timeout_seconds`, 30 minutes by
  default): a survivor waiting for a dead peer in a collective gives up after
  it. It bounds the time from a kill to the retried step; a step whose
  processes reach a collective further apart than it fails, so it must exceed
  the longest skew between processes inside one step.
- on GPU, the settings of JAX's fault-tolerance guide
  (https://docs.jax.dev/en/latest/fault_tolerance.html, its examples'
  preamble): `--xla_gpu_nccl_terminate_on_error=false`,
  `--xla_gpu_nccl_async_execution=true`,
  `--xla_gpu_nccl_blocking_communicators=false`,
  `XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE=1` and
  `XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1`, so a collective with a dead peer
  is aborted instead of hanging or ending the process.

The coordination service lives in process 0: when process 0 dies every
process ends, whatever the settings (JAX's guide says the same). A job that
must survive any training process's death gives process 0 no mesh device, so
it only hosts the service (`pjit-pipe train --processes N` does so:
docs/multiprocess.md).
"""

from __future__ import annotations

import os
from typing import Any

from pjit_pipe.errors import OptionError

HEARTBEAT_TIMEOUT_S = 4  # a dead process is noticed within about this long
COLLECTIVE_TIMEOUT_S = 6  # a survivor's collective with a dead peer gives up after this long
GPU_XLA_FLAGS = (  # JAX's fault-tolerance guide
    "--xla_gpu_nccl_terminate_on_error=false",
    "--xla_gpu_nccl_async_execution=true",
    "--xla_gpu_nccl_blocking_communicators=false",
)
GPU_ENV = {
    "XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1",
    "XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1",
}
PLATFORMS = ("cpu", "gpu")


def _add_xla_flags(*flags: str) -> None:
    """Append `flags` to XLA_FLAGS, replacing any earlier value of the same flag."""
    names = {f.split("=", 1)[0] for f in flags}
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join([*kept, *flags])


def _platform() -> str:
    """'cpu' or 'gpu': what the backend will be, read before it starts (JAX_PLATFORMS,
    else whether a CUDA or ROCm plugin of JAX is installed)."""
    import importlib.util

    import jax

    wanted = (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").lower()
    if wanted:
        first = wanted.split(",")[0].strip()
        return "gpu" if first in ("gpu", "cuda", "rocm") else "cpu"
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
    return "gpu" if any(importlib.util.find_spec(p) for p in plugins) else "cpu"


def recovery_settings(
    platform: str,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S,
) -> dict[str, Any]:
    """What `initialize_distributed` sets on `platform`, by where it goes.

    Args:
        platform: 'cpu' or 'gpu'.
        heartbeat_timeout_s: seconds of silence after which a process counts as dead.
        collective_timeout_s: seconds a CPU collective waits for a peer.

    Returns:
        {'config': {jax option: value}, 'xla_flags': [flag, ...], 'env': {variable:
        value}, 'initialize': {keyword of jax.distributed.initialize: value}}.

    Raises:
        OptionError: a platform other than 'cpu' or 'gpu', or a timeout that is not a
            positive whole number of seconds.
    """
    if platform not in PLATFORMS:
        raise OptionError(
            f"platform: expected one of {', '.join(PLATFORMS)} (or None: detected), got "
            f"{platform!r}"
        )
    for name, value in (
        ("heartbeat_timeout_s", heartbeat_timeout_s),
        ("collective_timeout_s", collective_timeout_s),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise OptionError(f"{name}: expected a positive whole number of seconds, got {value!r}")
    config: dict[str, Any] = {"jax_enable_recoverability": True}
    if platform == "cpu":
        config["jax_cpu_collectives_implementation"] = "gloo"
        flags = [f"--xla_cpu_collective_timeout_seconds={collective_timeout_s}"]
        env: dict[str, str] = {}
    else:
        flags, env = list(GPU_XLA_FLAGS), dict(GPU_ENV)
    return {
        "config": config,
        "xla_flags": flags,
        "env": env,
        "initialize": {"heartbeat_timeout_seconds": heartbeat_timeout_s},
    }


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    collective_timeout_s: int = COLLECTIVE_TIMEOUT_S,
    platform: str | None = None,
    **initialize_kwargs: Any,
) -> dict[str, Any]:
    """`jax.distributed.initialize` with the settings a job needs to outlive a dead process.

    Call it first thing in every process, before anything touches a device: the
    settings (module docstring) must be in place before the backend starts.
    Without arguments JAX detects the cluster (SLURM, Open MPI, Kubernetes, TPU
    pods); on one machine give the three, as `pjit-pipe train --processes`
    does. Then `ResilientTrainer` detects dead processes with `LiveDevices`.

    Args:
        coordinator_address: 'host:port' of process 0, or None (detected).
        num_processes: processes in the job, or None (detected).
        process_id: this process's index, or None (detected).
        heartbeat_timeout_s: seconds of silence after which a process counts as
            dead (JAX's default is 100).
        collective_timeout_s: on CPU, seconds a collective waits for a peer before
            failing (XLA's default is 1800).
        platform: 'cpu' or 'gpu', or None: JAX_PLATFORMS, else 'gpu' when a CUDA
            or ROCm plugin of JAX is installed.
        **initialize_kwargs: passed on to `jax.distributed.initialize`
            (`local_device_ids`, `initialization_timeout`, ...).

    Returns:
        What was set: `recovery_settings(platform, ...)`.

    Raises:
        OptionError: a bad platform or timeout, or JAX's backend already started
            (the settings would not take effect).
    """
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise OptionError(
            "initialize_distributed: JAX's backend has already started (something asked "
            "for devices or ran a computation), so the recovery settings cannot take "
            "effect; call it first, before any other JAX call"
        )
    settings = recovery_settings(platform or _platform(), heartbeat_timeout_s, collective_timeout_s)
    _add_xla_flags(*settings["xla_flags"])
    os.environ.update(settings["env"])
    for name, value in settings["config"].items():
        jax.config.update(name, value)
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        **{**settings["initialize"], **initialize_kwargs},
    )
    return settings
