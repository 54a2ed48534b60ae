"""Processes of one job started on this machine: their environment and a port.

`pjit-pipe train --processes` and `pjit-pipe emulate --processes` both start
one Python process per host on localhost, over `jax.distributed` with gloo on
CPU. Each child needs the same set-up: its own count of virtual CPU devices,
the package importable from this checkout, and no persistent compilation
cache from the environment (processes of a gloo job on CPU that load their
program from it hang in its first collective: jax 0.12, docs/multiprocess.md).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding pjit_pipe/
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the coordinator's)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def local_process_env(devices: int) -> dict[str, str]:
    """This environment for a child process with `devices` CPU devices, the package
    importable and no `JAX_COMPILATION_CACHE_DIR` (module docstring)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_FLAG)]
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    return {
        **env,
        "XLA_FLAGS": " ".join([*flags, f"{DEVICE_FLAG}={devices}"]),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
