"""The device mesh a pipeline runs on: axes ('data', 'stage', 'tensor'), shape (D, P, T).

'data' and 'stage' are the pipeline's own axes (replicas and stages); 'tensor'
splits each stage's annotated weights inside the stage (docs/tensor_parallel.md)
and is 1 unless asked for, so a model annotated for 'tensor' runs on any mesh.
A (data, stage) mesh of two axes, as earlier meshes were built, is taken as
tensor = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from pjit_pipe.errors import MeshError

AXES = ("data", "stage", "tensor")
PIPELINE_AXES = AXES[:2]  # a mesh without 'tensor' is read as tensor = 1


def make_mesh(
    data: int | None = None,
    stage: int | None = None,
    tensor: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    mapping: Sequence[Sequence[int]] | None = None,
) -> Mesh:
    """A (data, stage, tensor) mesh over the first data*stage*tensor of `devices`.

    Axis types are Auto so that inputs need no explicit sharding, and so that
    XLA partitions a stage's compute over 'tensor' (docs/design.md section 5).

    Args:
        data: D, the data-parallel replicas; None: 1, or the mapping's rows.
        stage: P, the pipeline stages; None: 1, or the mapping's columns.
        tensor: T, the devices that split each stage's annotated weights;
            None: 1.
        devices: the devices to build the mesh from; None: jax.devices().
        mapping: a planner's D x P device mapping instead (`Plan.mapping`):
            mapping[r][p] is the index in `devices` of the device that runs
            stage p of replica r; data and stage, if given, must match its
            shape (tensor = 1).

    Returns:
        The Mesh with axes ('data', 'stage', 'tensor') and shape (D, P, T).

    Raises:
        MeshError: data, stage or tensor is not a positive integer, more devices
            are needed than `devices` has, or a mapping comes with tensor > 1.
        ValueError: `mapping` is not D rows of P distinct device indices in
            range, or its shape differs from the data or stage given.
    """
    if mapping is not None:
        if tensor not in (None, 1):
            raise MeshError(
                f"make_mesh: a mapping places one device per worker, got tensor={tensor}"
            )
        return _mapped(mapping, data, stage, list(jax.devices() if devices is None else devices))
    data = 1 if data is None else data
    stage = 1 if stage is None else stage
    tensor = 1 if tensor is None else tensor
    for name, value in (("data", data), ("stage", stage), ("tensor", tensor)):
        if not isinstance(value, int | np.integer) or value < 1:
            raise MeshError(f"make_mesh: {name} must be a positive integer, got {value!r}")
    pool = list(jax.devices() if devices is None else devices)
    need = data * stage * tensor
    if need > len(pool):
        hint = ""
        if pool and pool[0].platform == "cpu":
            hint = (
                f"; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need} "
                "before JAX is imported"
            )
        raise MeshError(
            f"make_mesh: data*stage*tensor = {data}*{stage}*{tensor} = {need} devices needed, "
            f"only {len(pool)} available{hint}"
        )
    grid = np.array(pool[:need], dtype=object).reshape(data, stage, tensor)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def tensor_size(mesh: Mesh) -> int:
    """The mesh's 'tensor' size (1 for a two-axis (data, stage) mesh)."""
    return int(dict(mesh.shape).get("tensor", 1))


def worker_devices(mesh: Mesh) -> np.ndarray:
    """The (D, P, T) array of devices: worker (r, p)'s tensor group is [r, p]."""
    devices = np.asarray(mesh.devices, dtype=object)
    return devices if devices.ndim == 3 else devices[..., None]


def reorder_replicas(mesh: Mesh, order: Sequence[int]) -> Mesh:
    """The mesh whose replica row r holds `mesh`'s row order[r]: the same devices
    and stages, the replicas relabelled (replicas hold the same stage parameters,
    so a program for one pattern of workers serves its replica permutations).

    Args:
        mesh: A (data, stage[, tensor]) mesh.
        order: A permutation of range(data).

    Returns:
        The mesh with its rows reordered, axes and axis types kept.
    """
    rows = np.asarray(mesh.devices, dtype=object)[list(order)]
    return Mesh(rows, mesh.axis_names, axis_types=mesh.axis_types)


def pipeline_mesh(mesh: Mesh) -> Mesh:
    """The (data, stage) mesh of each worker's first device: one device per worker,
    where a program's per-worker arrays live (measurements, failure detection)."""
    return Mesh(worker_devices(mesh)[..., 0], PIPELINE_AXES, axis_types=(AxisType.Auto,) * 2)


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
    grid = np.array([[[pool[i]] for i in r] for r in rows], dtype=object)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)
