"""The device mesh a pipeline runs on: axes ('data', 'stage'), shape (D, P)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from pjit_pipe.errors import MeshError

AXES = ("data", "stage")


def make_mesh(data: int = 1, stage: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, stage) mesh over the first data*stage of `devices` (default: jax.devices()).

    Axis types are Auto so that inputs need no explicit sharding (docs/design.md section 5).
    """
    for name, value in (("data", data), ("stage", stage)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise MeshError(f"make_mesh: {name} must be a positive integer, got {value!r}")
    pool = list(jax.devices() if devices is None else devices)
    need = data * stage
    if need > len(pool):
        hint = ""
        if pool and pool[0].platform == "cpu":
            hint = (
                f"; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                "before JAX is imported"
            )
        raise MeshError(
            f"make_mesh: data*stage = {data}*{stage} = {need} devices needed, "
            f"only {len(pool)} available{hint}"
        )
    grid = np.array(pool[:need], dtype=object).reshape(data, stage)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
