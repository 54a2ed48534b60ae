"""The devices one compiled program runs on: the live workers of a D x P deployment.

Fault-free, that is the whole (data, stage) mesh and the gradient reduction is a
psum over 'data'. After failures the live devices no longer form a rectangle,
so the program runs on a one-axis mesh ('worker') of the survivors, in
(replica, stage) order; messages between any two workers are ppermutes over
that axis (the one collective that works over any device subset), and each
stage's gradients are reduced over its surviving holders with a ppermute
chain. Either way a worker's linear index is its position in `workers`, which
is the row it owns in every per-worker array of the program.

With a 'tensor' axis of size T > 1 a worker is a group of T devices: the
program's mesh keeps 'tensor' as its last axis, the program's shard_map is
manual over the worker axes only, and XLA partitions each stage's compute
over 'tensor' (docs/tensor_parallel.md). With T = 1 the mesh has the worker
axes alone, as without tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as PS

from pjit_pipe.ir.ops import Worker

AXES = ("data", "stage")
SURVIVOR_AXIS = "worker"
TENSOR = "tensor"


def over_devices(collective: Any, tree: Any, axes: str | Sequence[str]) -> Any:
    """`collective(tree, axes)` (lax.psum, lax.pmax, ...) over those of the named
    `axes` that have more than one device, inside shard_map; `tree` itself when
    none has.

    A reduction over one device is the value itself, and emitting it anyway is
    an error: with one worker (a 1 x 1 x T mesh) the partial-manual region's
    manual group has one device, XLA treats the region as not manual, and its
    SPMD partitioner refuses any cross-partition all-reduce in it."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = tuple(a for a in names if lax.axis_size(a) > 1)
    return collective(tree, kept) if kept else tree


@dataclass(frozen=True)
class Topology:
    """Live workers, the mesh over their devices, and how to reduce over replicas."""

    replicas: int
    stages: int
    workers: tuple[Worker, ...]
    mesh: Mesh

    @classmethod
    def of(cls, mesh: Mesh, failed: Sequence[Worker] = ()) -> Topology:
        """The topology of `mesh` (axes data, stage[, tensor]) with `failed` workers removed."""
        D, P = mesh.shape["data"], mesh.shape["stage"]
        dead = {Worker(*w) for w in failed}
        workers = tuple(
            Worker(r, p) for r in range(D) for p in range(P) if Worker(r, p) not in dead
        )
        grid = np.asarray(mesh.devices, dtype=object)
        if grid.ndim == 2:
            grid = grid[..., None]
        tensor = (TENSOR,) if grid.shape[2] > 1 else ()
        if not tensor:
            grid = grid[..., 0]
        if not dead:
            sub = Mesh(grid, AXES + tensor, axis_types=(AxisType.Auto,) * (2 + len(tensor)))
        else:
            devices = np.array([grid[w.replica, w.stage] for w in workers], dtype=object)
            sub = Mesh(
                devices, (SURVIVOR_AXIS, *tensor), axis_types=(AxisType.Auto,) * (1 + len(tensor))
            )
        return cls(D, P, workers, sub)

    @property
    def tensor(self) -> int:
        """T, the devices of one worker (its 'tensor' group)."""
        return int(dict(self.mesh.shape).get(TENSOR, 1))

    @property
    def device_positions(self) -> np.ndarray:
        """Pipeline position of each device of the mesh, in `mesh.devices.flat` order."""
        return np.repeat(self.positions, self.tensor)

    @property
    def tensor_index(self) -> np.ndarray:
        """Each device's index in its worker's tensor group, in `mesh.devices.flat` order."""
        return np.tile(np.arange(self.tensor), len(self.workers))

    def shard_map_axes(self) -> dict[str, Any]:
        """Extra shard_map arguments: manual over the worker axes only when the mesh
        has a 'tensor' axis, which XLA partitions (partial-manual shard_map)."""
        return {"axis_names": set(self.axes)} if self.tensor > 1 else {}

    @property
    def axes(self) -> tuple[str, ...]:
        """The worker axes (every mesh axis but 'tensor'): collectives over all
        workers name these."""
        return tuple(a for a in self.mesh.axis_names if a != TENSOR)

    @property
    def spec(self) -> PS:
        """Sharding of a per-worker array: its leading dimension over every axis."""
        return PS(self.axes)

    @property
    def complete(self) -> bool:
        return len(self.workers) == self.replicas * self.stages

    def index(self, worker: Worker) -> int:
        """The worker's linear index (its row in per-worker arrays)."""
        return self.workers.index(worker)

    @property
    def positions(self) -> np.ndarray:
        """Pipeline position of each live worker, by linear index."""
        return np.array([w.stage for w in self.workers], np.int32)

    def holders(self, position: int) -> list[int]:
        """Linear indices of the live workers of one pipeline position."""
        return [i for i, w in enumerate(self.workers) if w.stage == position]

    def psum(self, tree: Any, axes: Sequence[str]) -> Any:
        """`lax.psum` of `tree` over those of `axes` with more than one device
        (`over_devices`: none at all on a 1 x 1 x T mesh)."""
        return over_devices(lax.psum, tree, axes)

    def reduce_over_replicas(self, tree: Any, positions: Sequence[int] | None = None) -> Any:
        """Sum over the live replicas of each worker's stage (inside shard_map).

        With a member missing there is no mesh axis to psum over, so the sum
        runs down a chain of ppermutes (holder 0 -> 1 -> ... -> last, adding)
        and the total comes back up the chain. Every holder then has the same
        bits, summed in one fixed order, so replicas stay identical. The chain
        sums the holders of `positions` alone (None: every position); every
        device must run it (it is one set of collectives), and any other
        device's tree comes back as it was.
        """
        if self.complete:
            return self.psum(tree, ("data",))
        positions = range(self.stages) if positions is None else positions
        groups = [self.holders(p) for p in positions]
        if not groups:
            return tree
        rounds = max(len(g) for g in groups) - 1
        me = lax.axis_index(SURVIVOR_AXIS)
        for k in range(rounds):
            pairs = [(g[k], g[k + 1]) for g in groups if len(g) > k + 1]
            tree = jax.tree.map(lambda a, p=pairs: a + lax.ppermute(a, SURVIVOR_AXIS, p), tree)
        for k in range(rounds):
            pairs = [(g[-1 - k], g[-2 - k]) for g in groups if len(g) > k + 1]
            takes = np.zeros(len(self.workers), bool)
            takes[[dst for _, dst in pairs]] = True
            mine = jnp.asarray(takes)[me]

            def down(a, p=pairs, mine=mine):
                return jnp.where(mine, lax.ppermute(a, SURVIVOR_AXIS, p), a)

            tree = jax.tree.map(down, tree)
        return tree
