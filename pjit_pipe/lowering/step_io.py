"""How the compiled step's arguments cross the shard_map boundary.

Per-stage trees are packed into (devices, v, L) buffers and back inside the
jitted function; each device gets its own batch rows, tick rows and pipeline
position; buffers of weights split over 'tensor' are constrained to their split
outside the shard_map (whose specs name the worker axes only). `PipelineStep`
(step.py) builds its entry points on these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.comms.topology import Topology
from pjit_pipe.lowering.compute.tick import TickProgram
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, is_shaped
from pjit_pipe.lowering.shard_map_operands import shard_map_without_empty_operands
from pjit_pipe.lowering.tick_plan import TickPlan


class StepIO:
    """The buffer and batch plumbing of one compiled program (a base of PipelineStep)."""

    schedule: Schedule
    topology: Topology
    _low: TickProgram
    _positions: np.ndarray  # (devices,): each live device's pipeline position
    _first_holder: np.ndarray  # (P,): the device each position's state is read from

    @property
    def mesh(self) -> Mesh:
        """The mesh the program runs on (the survivors' one-axis mesh after failures)."""
        return self.topology.mesh

    # ---- host layout <-> device layout (traced inside jit) ----

    def _pack(self, spec: FlatSpec, trees: Sequence[Any]) -> Buffers:
        """Per-stage trees -> (devices, v, L) buffers: each live worker's held chunks."""
        held = self._low.held
        rows = [[spec.pack(s, trees[s]) for s in chunks] for chunks in held]
        by_position = {
            k: jnp.stack([jnp.stack([r[k] for r in pr]) for pr in rows]) for k in spec.sizes
        }
        return {k: b[self._positions] for k, b in by_position.items()}

    def _unpack(self, spec: FlatSpec, bufs: Buffers) -> list[Any]:
        """(devices, v, L) buffers -> per-stage trees, read from each position's first holder."""
        sched = self.schedule
        return [
            spec.unpack(
                s,
                {
                    k: b[self._first_holder[sched.layout[s]], sched.chunk_of(s)]
                    for k, b in bufs.items()
                },
            )
            for s in range(sched.num_virtual_stages)
        ]

    def _device_batch(self, x: Any, plan: TickPlan) -> Any:
        """Batch -> (devices, L, rows, ...): each device's own microbatch list.

        `x` has a leading iterations axis when the program runs several."""
        D, m = self.schedule.replicas, self.schedule.microbatches
        it, r, j = (plan.inputs[..., i] for i in range(3))

        def split(a):
            if self._low.iterations == 1:
                a = a[None]
            return a.reshape(a.shape[0], D, m, a.shape[1] // (D * m), *a.shape[2:])[it, r, j]

        return jax.tree.map(split, x)

    def _shard_map(self, body: Callable, n_in_bufs: int, out_specs: Any, n_replicated: int = 0):
        """body over the program's mesh: `n_in_bufs` buffers and the four
        `_device_args` per device, then `n_replicated` arrays every device sees whole."""
        spec = self.topology.spec
        return shard_map_without_empty_operands(
            body,
            mesh=self.mesh,
            in_specs=(spec,) * (n_in_bufs + 4) + (PS(),) * n_replicated,
            out_specs=out_specs,
            check_vma=False,
            **self.topology.shard_map_axes(),
        )

    def _placed(self, spec: FlatSpec, bufs: Buffers) -> Buffers:
        """`bufs` with each shaped buffer (a leaf split over 'tensor') constrained to
        its split: shard_map specs name the worker axes only, so the split of the
        state in and out of the step is set here, outside it."""
        if not spec.tensor_split:
            return bufs
        axes = self.topology.axes
        return {
            k: jax.lax.with_sharding_constraint(
                b, NamedSharding(self.mesh, PS(axes, None, *spec.split_of(k)))
            )
            if is_shaped(k)
            else b
            for k, b in bufs.items()
        }

    def _device_args(self, x, y, plan: TickPlan):
        """Per-device inputs after the buffers: batch, labels, tick rows, positions."""
        return (
            self._device_batch(x, plan),
            self._device_batch(y, plan),
            jax.tree.map(jnp.asarray, plan.rows),
            jnp.asarray(self._positions),
        )

    @staticmethod
    def _local(*trees):
        return tuple(jax.tree.map(lambda a: a[0], t) for t in trees)
