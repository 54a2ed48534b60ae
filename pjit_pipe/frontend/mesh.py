"""The device mesh a pipeline runs on: axes ('data', 'stage'), shape (D, P)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from pjit_pipe.errors import MeshError

AXES = ("data", "stage")


def make_mesh(
    data: int | None = None,
    stage: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    mapping: Sequence[Sequence[int]] | None = None,
) -> Mesh:
    """A (data, stage) mesh over the first data*stage of `devices` (default: jax.devices()).

    `mapping`: a planner's D x P device mapping instead (`Plan.mapping`):
    mapping[r][p] is the index in `devices` of the device that runs stage p of
    replica r; data and stage, if given, must match its shape.
    Axis types are Auto so that inputs need no explicit sharding (docs/design.md section 5).
    """
    if mapping is not None:
        return _mapped(mapping, data, stage, list(jax.devices() if devices is None else devices))
    data = 1 if data is None else data
    stage = 1 if stage is None else stage
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


def _mapped(
    mapping: Sequence[Sequence[int]], data: int | None, stage: int | None, pool: list
) -> Mesh:
    """The mesh whose (r, p) device is pool[mapping[r][p]]."""
    rows = [list(r) for r in mapping]
    width = {len(r) for r in rows}
    flat = [i for r in rows for i in r]
    if not rows or len(width) != 1 or not all(isinstance(i, int | np.integer) for i in flat):
        raise ValueError(
            f"make_mesh: mapping must be D rows of P device indices each, got {mapping!r}"
        )
    bad = [i for i in flat if not 0 <= i < len(pool)]
    if bad or len(set(flat)) != len(flat):
        raise ValueError(
            f"make_mesh: mapping must name distinct devices 0..{len(pool) - 1}, got {rows} "
            f"({'out of range: ' + str(bad) if bad else 'a device used twice'})"
        )
    shape = (len(rows), width.pop())
    for name, value, size in (("data", data, shape[0]), ("stage", stage, shape[1])):
        if value is not None and value != size:
            raise ValueError(f"make_mesh: {name}={value} but the mapping has {size} ({rows})")
    grid = np.array([[pool[i] for i in r] for r in rows], dtype=object)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
