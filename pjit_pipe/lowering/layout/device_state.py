"""Training state in the device layout: each device holds only the stages it runs.

A compiled pipeline keeps its parameters and optax state between steps as
buffers of shape (devices, v, L), sharded over the program's mesh by their
leading dimension: row i is device i's own `v` chunks, each chunk one
virtual stage's tree flattened by a `FlatSpec`. The buffers are the size
classes of param_layout.py (a row per leaf size, "float32#4096#0"), or
where those would cost too much memory one flat row per dtype zero padded
to the longest stage (L). A device therefore holds its stages and the
padding up to the largest stage, and nothing else; data-parallel peers of a
stage hold equal rows. The train step takes and returns these buffers, so no step gathers or
re-splits the model.

`DeviceLayout` converts between this layout and per-stage trees outside the
step, one pipeline position at a time on that position's devices only (a
small program over the position's holders), so the whole model never sits
on one device. `relayout` moves a state to another program's layout (a
failure variant, or back to the full mesh; relayout.py): a device that runs the
same position in both keeps its buffers, a device new to a position copies the
row from a live peer, and devices named unavailable are never read.

With a 'tensor' axis (T > 1) a worker is T devices. The flat rows are
replicated over them, and each leaf split over 'tensor' has a shaped buffer
(packing.py) of shape (workers, v, *leaf shape) split on the leaf's own
dimension: a device holds its slice of its stages' split weights and of their
optax state, between steps too (docs/tensor_parallel.md).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from pjit_pipe.errors import StateError
from pjit_pipe.lowering.comms.topology import TENSOR, Topology
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, dtype_of, is_shaped
from pjit_pipe.lowering.layout.relayout import relayout_state
from pjit_pipe.lowering.layout.zero import ZeroLayout

HOLDER = "holder"  # a position's sub-mesh: its workers (and 'tensor', with T > 1)


def _nbytes(spec: FlatSpec, s: int) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in spec.avals[s])


def leaf_splits(spec: FlatSpec, s: int) -> list[tuple]:
    """How each leaf of tree s splits over 'tensor' (() for a replicated one)."""
    return [spec.splits[k] if is_shaped(k) else () for k, _, _ in spec.slots[s]]


class DeviceLayout:
    """Where one program keeps each stage's parameter and optimizer-state rows.

    topology: the program's live workers and mesh; held[p]: the virtual stages
    position p runs (its chunks, in order); param_spec / opt_spec: how one
    stage's parameter tree / optax state flattens into a row.
    """

    def __init__(
        self,
        topology: Topology,
        held: Sequence[Sequence[int]],
        param_spec: FlatSpec,
        opt_spec: FlatSpec,
        optimizer: optax.GradientTransformation,
        zero: ZeroLayout | None = None,
    ):
        self.topology = topology
        self.zero = zero  # ZeRO: each worker's optax rows are its replica's slices (zero.py)
        self.held = [list(h) for h in held]
        self.specs = {"params": param_spec, "opt": opt_spec}  # one stage's trees <-> a row
        # The buffers' own layouts: ZeRO-3 keeps the parameters in slices (zero.py).
        self.row_specs = {
            "params": param_spec if zero is None else zero.rows_spec,
            "opt": opt_spec,
        }
        self.optimizer = optimizer
        self.devices = list(topology.mesh.devices.flat)  # every device, worker-major
        self.positions = [int(p) for p in topology.device_positions]
        self.tensor_index = [int(t) for t in topology.tensor_index]
        self.sharding = NamedSharding(topology.mesh, topology.spec)
        self._packers: dict[tuple[int, bool], Any] = {}
        self._unpackers: dict[tuple[int, tuple], Any] = {}

    # ---- shapes ----

    def shapes(self, part: str) -> dict[str, tuple[int, ...]]:
        """Global shape of each buffer of `part` ('params' or 'opt')."""
        v, spec = len(self.held[0]), self.row_specs[part]
        return {k: (len(self.topology.workers), v, *spec.shapes[k]) for k in spec.sizes}

    def sharding_of(self, part: str, key: str) -> NamedSharding:
        """Buffer `key` of `part` on the program's mesh: its leading dimension over the
        workers, and a shaped buffer's leaf dimension over 'tensor'."""
        spec = self.row_specs[part]
        if not is_shaped(key):
            return self.sharding
        return NamedSharding(self.topology.mesh, PS(self.topology.axes, None, *spec.split_of(key)))

    def avals(self) -> tuple[dict, dict]:
        """(params, opt) buffers as placed ShapeDtypeStructs, for AOT compilation."""
        return tuple(
            {
                k: jax.ShapeDtypeStruct(shape, dtype_of(k), sharding=self.sharding_of(part, k))
                for k, shape in self.shapes(part).items()
            }
            for part in ("params", "opt")
        )

    def compatible(self, other: DeviceLayout, position: int) -> bool:
        """Whether a row of `other` at `position` is a row of this layout there."""
        return other.held[position] == self.held[position] and all(
            (mine[k].sizes, mine[k].slots, mine[k].treedefs)
            == (theirs[k].sizes, theirs[k].slots, theirs[k].treedefs)
            for mine, theirs in ((self.specs, other.specs), (self.row_specs, other.row_specs))
            for k in mine
        )

    def ideal_bytes(self, position: int) -> int:
        """Bytes of the parameters and optimizer state of the stages `position` runs."""
        return sum(_nbytes(spec, s) for spec in self.specs.values() for s in self.held[position])

    def holders(self, position: int, skip: Collection[Any] = ()) -> list[Any]:
        """Devices of one position, in linear order, leaving out `skip`."""
        return [
            d
            for d, p in zip(self.devices, self.positions, strict=True)
            if p == position and d not in skip
        ]

    def stage_sharding(self, position: int) -> NamedSharding:
        """A stage tree's leaves on `position`'s devices, replicated there."""
        return NamedSharding(self.position_mesh(position), PS())

    def leaf_shardings(self, part: str, s: int, mesh: Mesh) -> Any:
        """Stage s's tree of `part` as shardings on a position's mesh: a leaf split
        over 'tensor' split there, the others replicated."""
        spec = self.specs[part]
        tensor = TENSOR in mesh.axis_names
        leaves = [NamedSharding(mesh, PS(*h) if tensor else PS()) for h in leaf_splits(spec, s)]
        return jax.tree.unflatten(spec.treedefs[s], leaves)

    def position_mesh(self, position: int, skip: Collection[Any] = ()) -> Mesh:
        """The devices of one position as a (holder[, tensor]) mesh: a row per worker."""
        devices = np.array(self.holders(position, skip), dtype=object)
        T = self.topology.tensor
        if T == 1:
            return Mesh(devices, (HOLDER,))
        return Mesh(devices.reshape(-1, T), (HOLDER, TENSOR))

    # ---- per-stage trees -> device layout ----

    def from_stages(
        self, stage_params: Sequence[Any], stage_opt: Sequence[Any] | None = None
    ) -> tuple[Buffers, Buffers]:
        """Per-virtual-stage parameter trees (and optax states; None: optimizer.init
        of each stage) -> (params, opt) buffers. Each position's rows are built on
        that position's devices from its own stages' leaves only."""
        rows: dict[str, dict[str, dict[Any, jax.Array]]] = {"params": {}, "opt": {}}
        for p in range(len(self.held)):
            devices = self.holders(p)
            if not any(d.process_index == jax.process_index() for d in devices):
                continue  # another process builds these rows
            mesh = self.position_mesh(p)
            trees = [stage_params[s] for s in self.held[p]]
            opts = None if stage_opt is None else [stage_opt[s] for s in self.held[p]]
            where = (
                [self.leaf_shardings("params", s, mesh) for s in self.held[p]],
                None
                if opts is None
                else jax.tree.map(lambda _, m=mesh: NamedSharding(m, PS()), opts)
                if self.zero is not None  # module-layout optax trees, not slices
                else [self.leaf_shardings("opt", s, mesh) for s in self.held[p]],
            )
            args = jax.tree.map(_onto, (trees, opts), where)
            packed = self._packer(p, opts is None, mesh)(*args)
            for part, bufs in zip(("params", "opt"), packed, strict=True):
                for k, b in bufs.items():
                    for shard in b.addressable_shards:
                        rows[part].setdefault(k, {})[shard.device] = shard.data
        return tuple(self.assemble(part, rows[part]) for part in ("params", "opt"))

    def _packer(self, p: int, init_opt: bool, mesh: Mesh):
        key = (p, init_opt)
        if key not in self._packers:
            held, specs, opt = self.held[p], self.specs, self.optimizer

            workers = mesh.shape[HOLDER]
            replicas = [self.topology.workers[i].replica for i in self.topology.holders(p)]
            zero = self.zero

            def pack(trees, opts):
                if zero is not None:  # each holder: the optax state of its replica's slices
                    rows = specs["params"]
                    packed = [rows.pack(s, t) for s, t in zip(held, trees, strict=True)]
                    chunks = {k: jnp.stack([r[k] for r in packed]) for k in rows.sizes}
                    if zero.level == 3:  # and its replica's parameter slices
                        params = zero.holder_param_rows(chunks, replicas)
                    else:
                        params = {
                            k: jnp.broadcast_to(b, (workers, *b.shape)) for k, b in chunks.items()
                        }
                    return params, zero.holder_rows(chunks, opts, held, rows, replicas)
                if init_opt:
                    opts = [opt.init(t) for t in trees]
                out = []
                for spec, parts in ((specs["params"], trees), (specs["opt"], opts)):
                    r = [spec.pack(s, t) for s, t in zip(held, parts, strict=True)]
                    out.append(
                        {
                            k: jnp.broadcast_to(
                                jnp.stack([x[k] for x in r]), (workers, len(r), *spec.shapes[k])
                            )
                            for k in spec.sizes
                        }
                    )
                return tuple(out)

            out_shardings = tuple(
                {k: self._row_sharding(part, k, mesh) for k in self.row_specs[part].sizes}
                for part in ("params", "opt")
            )
            self._packers[key] = jax.jit(pack, out_shardings=out_shardings)
        return self._packers[key]

    def _row_sharding(self, part: str, key: str, mesh: Mesh) -> NamedSharding:
        """A buffer's rows on a position's mesh: a row per worker, a shaped buffer
        split over 'tensor' as on the program's mesh."""
        if TENSOR not in mesh.axis_names or not is_shaped(key):
            return NamedSharding(mesh, PS(HOLDER))
        return NamedSharding(mesh, PS(HOLDER, None, *self.row_specs[part].split_of(key)))

    def assemble(self, part: str, rows: dict[str, dict[Any, jax.Array]]) -> Buffers:
        """Global buffers from each addressable device's own (1, v, ...) slice."""
        out = {}
        for k, shape in self.shapes(part).items():
            local = [rows[k][d] for d in self.devices if d.process_index == jax.process_index()]
            sharding = self.sharding_of(part, k)
            out[k] = jax.make_array_from_single_device_arrays(shape, sharding, local)
        return out

    # ---- device layout -> per-stage trees ----

    def to_stages(
        self, params: Buffers, opt: Buffers, skip: Collection[Any] = ()
    ) -> tuple[list[Any], list[Any]]:
        """(params, opt) buffers -> per-virtual-stage (parameter trees, optax states),
        each leaf replicated on the live devices of the position that runs it (read
        from those devices' own rows; devices in `skip` are never read)."""
        n = sum(len(h) for h in self.held)
        out_p: list[Any] = [None] * n
        out_o: list[Any] = [None] * n
        for p in range(len(self.held)):
            devices = self.holders(p, skip)
            if not devices:
                raise StateError(f"position {p} has no live device to read its stages from")
            mesh = self.position_mesh(p, skip)
            if not any(d.process_index == jax.process_index() for d in devices):
                # Another process holds these stages: arrays with no local shards.
                for s in self.held[p]:
                    out_p[s], out_o[s] = (_remote(t, mesh) for t in self._stage_avals(s))
                continue
            bufs = [
                self._rows(part, b, devices, mesh) for part, b in (("params", params), ("opt", opt))
            ]
            trees, opts = self._unpacker(p, mesh, self._live_replicas(p, skip))(*bufs)
            for s, t, o in zip(self.held[p], trees, opts, strict=True):
                out_p[s], out_o[s] = t, o
        return out_p, out_o

    def _stage_avals(self, s: int) -> tuple[Any, Any]:
        """Stage `s`'s (parameter tree, optax state) in the module layout, as avals:
        with ZeRO the optax state of `optimizer.init` on the whole stage (what
        `zero.stage_states` gives), not the slices' tree."""
        params = self.specs["params"]
        tree = jax.tree.unflatten(params.treedefs[s], params.avals[s])
        if self.zero is not None:
            return tree, jax.eval_shape(self.optimizer.init, tree)
        opt = self.specs["opt"]
        return tree, jax.tree.unflatten(opt.treedefs[s], opt.avals[s])

    def _rows(self, part: str, bufs: Buffers, devices: list[Any], mesh: Mesh) -> Buffers:
        """The rows of `devices` as buffers over their own sub-mesh (no copy)."""
        out = {}
        for k, b in bufs.items():
            shards = {s.device: s for s in b.addressable_shards}
            local = [shards[d].data for d in devices if d in shards]
            shape = (mesh.shape[HOLDER], *b.shape[1:])
            out[k] = jax.make_array_from_single_device_arrays(
                shape, self._row_sharding(part, k, mesh), local
            )
        return out

    def _live_replicas(self, p: int, skip: Collection[Any]) -> list[int]:
        """The replicas of position p's workers none of whose devices is in `skip`."""
        T, workers = self.topology.tensor, self.topology.workers
        return [
            workers[i].replica
            for i in self.topology.holders(p)
            if not any(self.devices[i * T + t] in skip for t in range(T))
        ]

    def _unpacker(self, p: int, mesh: Mesh, live: list[int]):
        key = (p, tuple(mesh.devices.flat))
        if key not in self._unpackers:
            held, specs, zero = self.held[p], self.specs, self.zero
            sources = zero.sources(live) if zero is not None else None

            def unpack(params, opt):
                if zero is not None and zero.level == 3:  # the holders' slices joined
                    rows = [zero.whole_rows(params, c, sources) for c in range(len(held))]
                else:
                    rows = [{k: b[0, c] for k, b in params.items()} for c in range(len(held))]
                trees = [specs["params"].unpack(s, r) for s, r in zip(held, rows, strict=True)]
                if zero is not None:  # the holders' slices joined (zero.py)
                    return trees, zero.stage_states(opt, held, specs["params"], sources)
                opts = [
                    specs["opt"].unpack(s, {k: b[0, c] for k, b in opt.items()})
                    for c, s in enumerate(held)
                ]
                return trees, opts

            out_shardings = tuple(
                [self.leaf_shardings(part, s, mesh) for s in held] for part in ("params", "opt")
            )
            if zero is not None:  # replicated on the position's devices
                out_shardings = (out_shardings[0], [NamedSharding(mesh, PS())] * len(held))
            self._unpackers[key] = jax.jit(unpack, out_shardings=out_shardings)
        return self._unpackers[key]

    # ---- another program's layout -> this one ----

    def relayout(
        self,
        source: DeviceLayout,
        params: Buffers,
        opt: Buffers,
        unavailable: Collection[Any] = (),
    ) -> tuple[Buffers, Buffers, int]:
        """A state in `source`'s layout -> this layout, and the bytes copied
        (relayout.py: kept rows, rows copied from live peers)."""
        return relayout_state(self, source, params, opt, unavailable)


def _onto(leaf: Any, sharding: NamedSharding) -> jax.Array:
    """`leaf` placed by `sharding`. Multi-controller JAX cannot move an array between
    two device sets across processes, so a replicated leaf held elsewhere (a step
    count shared by all stages) goes through this process's own copy."""
    if (
        isinstance(leaf, jax.Array)
        and jax.process_count() > 1
        and leaf.sharding.device_set != sharding.device_set
    ):
        leaf = np.asarray(leaf.addressable_data(0))
    return jax.device_put(leaf, sharding)


def _remote(tree: Any, mesh: Mesh) -> Any:
    """`tree`'s avals as global arrays replicated on `mesh`, none of whose devices is
    this process's (a stage another process holds)."""
    sharding = NamedSharding(mesh, PS())
    return jax.tree.map(
        lambda a: jax.make_array_from_single_device_arrays(a.shape, sharding, [], dtype=a.dtype),
        tree,
    )


def device_bytes(*trees: Any) -> dict[Any, int]:
    """Bytes each device holds of the arrays in `trees` (its shards only)."""
    held: dict[Any, int] = {}
    for a in jax.tree.leaves(trees):
        for shard in a.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held
