"""Which devices a command-line run uses: the accelerators when there are enough
for the mesh, else as many virtual CPU devices.

`make demo` and `pjit-pipe train` default to meshes of 8 devices, which a laptop
or a one-GPU machine does not have. Rather than stop, they say so and run on
virtual CPU devices (XLA's host platform, which `ensure_host_devices` sized
before JAX started), so the same command works on any machine.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from functools import cache
from typing import Any

DEVICE_FLAG = "--xla_force_host_platform_device_count"


def ensure_host_devices(count: int) -> None:
    """Ask XLA for at least `count` CPU devices, if JAX has not been imported yet."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    found = re.search(rf"{DEVICE_FLAG}=(\d+)", flags)
    if found and int(found[1]) >= count:
        return
    flags = re.sub(rf"\s*{DEVICE_FLAG}=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()


def choose_devices(
    need: int, default: Sequence[Any], cpus: Sequence[Any]
) -> tuple[list[Any], str | None]:
    """The `need` devices to run on, and a note when they are not the default ones.

    Args:
        need: how many devices the mesh needs (D * P * T).
        default: the default backend's devices (`jax.devices()`).
        cpus: the host platform's devices (`jax.devices("cpu")`).

    Returns:
        (devices, note): the first `need` default devices when there are enough;
        else the first `need` CPU devices and a one-line note saying why.

    Raises:
        MeshError: when neither has `need` devices (the CPU count is fixed once
            JAX has started: set XLA_FLAGS before it does).
    """
    from pjit_pipe.errors import MeshError

    if len(default) >= need:
        return list(default[:need]), None
    if len(cpus) >= need:
        platform = default[0].platform if default else "accelerator"
        note = (
            f"only {len(default)} {platform} device(s), the mesh needs {need}: "
            f"running on {need} virtual CPU devices instead"
        )
        return list(cpus[:need]), note
    raise MeshError(
        f"the mesh needs {need} devices; {len(default)} {default[0].platform if default else ''} "
        f"and {len(cpus)} CPU devices are available: use a smaller --mesh, or set "
        f"XLA_FLAGS={DEVICE_FLAG}={need} before JAX starts"
    )


@cache
def run_devices(need: int) -> list[Any]:
    """`choose_devices` on this machine (once per size: the note is said once); CPU fallback also makes the CPU the default
    device, so that arrays made outside the mesh (initial parameters) live there too.
    The note goes to stderr, keeping stdout for `--json`."""
    import jax

    devices, note = choose_devices(need, jax.devices(), jax.devices("cpu"))
    if note:
        print(f"note: {note}", file=sys.stderr, flush=True)
        jax.config.update("jax_default_device", devices[0])
    return devices
