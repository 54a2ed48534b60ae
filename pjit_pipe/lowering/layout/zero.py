"""ZeRO over 'data': each stage's optimizer state (and with ZeRO-3 its parameters)
sharded over its D replicas.

With `zero=True` a worker (r, p) keeps the full parameters of its stages (the
forward and backward read them every tick) but only slice r of their optax
state. Each parameter buffer of the device layout (a size class or a flat
row per dtype, padded to a multiple of D, or a shaped buffer of a leaf split over 'tensor';
packing.py) is cut into D equal slices along one dimension: the row itself,
or the first dimension of a shaped buffer that 'tensor' does not split and D
divides (a shaped buffer with none keeps its optax state whole on every
replica).

After the tick loop the gradients are reduce-scattered over 'data'
(`lax.psum_scatter`: replica r receives the sum of slice r; with
grad_sum="slices" each W's gradient is, as it is made: `add_scattered`), replica r runs
the optax update on its slices only, and the updated slices are all-gathered
over 'data' once per step. Each replica also keeps a copy of the next
replica's slice state (sent by a ppermute over 'data' after each update), so
a failed worker's slices survive on its neighbour: the optax state a device
holds is 2/D of its stages' instead of 1/D. The update runs on a tree of slices, {buffer key:
slice}, the same tree for every stage, so no switch on the pipeline position
is needed; the optimizer must therefore be elementwise per parameter (adam,
adamw, sgd, momentum, ...): a transformation that needs a whole parameter's
shape or the model's tree (a mask over the parameter tree, per-leaf norms,
factored second moments) is refused or fails when its state is built
(docs/tensor_parallel.md). A norm of the whole update (a global-norm clip) is
one reduction of the slices' norms (zero_norms.py).

ZeRO-3 (`level=3`) keeps the parameters in the same slices: between steps a
worker holds (its slice, a copy of the next replica's) of each parameter
buffer, like the optax state (`rows_spec`). The step all-gathers the whole
rows over 'data' once, before the tick loop (`gather`), and after the update
sends each replica's new slices to the previous replica for its copy instead
of all-gathering them. The parameters at rest are then 2/D of the stage's; the
step still holds one whole copy of them while the loop runs, in the compute
dtype: a buffer whose every leaf the model reads through a cast to bf16 is
gathered in bf16 (half the bytes), the others in their own dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from pjit_pipe.errors import OptimizerError, StateError
from pjit_pipe.lowering.comms.topology import over_devices
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, dtype_of, is_shaped
from pjit_pipe.lowering.layout.global_norm import StageNorms, count_norm_calls, stage_norms
from pjit_pipe.lowering.layout.shared import SharedGrads
from pjit_pipe.lowering.layout.tensor_layout import opt_state_splits
from pjit_pipe.lowering.layout.zero_norms import SliceNorms

DATA = "data"


def _masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


def _like(tree: Any):
    """Whether a node of an optax state is shaped like the parameter tree `tree`."""
    treedef = jax.tree.structure(tree, _masked)
    return lambda node: jax.tree.structure(node, _masked) == treedef


class ZeroLayout:
    """Where each parameter buffer is cut into D slices, and the sliced optax state.

    param_spec: the chunk rows' layout (flat rows padded to a multiple of D);
    stages: the virtual stages (the optax state has one identical tree per
    stage, so the device layout indexes it like the parameters'); held[p][c]:
    the virtual stage at position p, chunk c; shared: the sum of tied weights'
    gradients over their holders (shared.py), or None.
    """

    def __init__(
        self,
        param_spec: FlatSpec,
        replicas: int,
        optimizer: optax.GradientTransformation,
        stages: int,
        held: Sequence[Sequence[int]],
        shared: SharedGrads | None,
        level: int = 1,
        gather_dtypes: Mapping[str, str] | None = None,
        reduce_in_compute: bool = False,
    ):
        self.D, self.optimizer, self.level = replicas, optimizer, level
        # ZeRO-3: per buffer key, the compute dtype it is all-gathered in (bf16 where
        # every leaf in it is read through a cast to bf16, compute/compute_dtype.py);
        # a buffer not named is gathered in its own dtype.
        self.gather_dtypes = dict(gather_dtypes or {})
        self.param_spec = param_spec  # one stage's whole rows (the tick loop's layout)
        # Per buffer key: the dimension (of one chunk's buffer) cut into D slices, or None.
        self.dims: dict[str, int | None] = {}
        for k, shape in param_spec.shapes.items():
            split = param_spec.split_of(k) if is_shaped(k) else (None,)
            free = [d for d, n in enumerate(shape) if split[d] is None and n % replicas == 0]
            self.dims[k] = free[0] if free else None
        # Per buffer key, the dtype a W's gradient row is reduce-scattered in when it
        # is not the buffer's own: with grad_sum="slices-compute" the compute dtype,
        # for the flat rows (XLA's CPU backend fails to compile a bf16 reduce-scatter
        # of a buffer split over 'tensor', "Invalid binary instruction opcode copy":
        # those sum in their own dtype).
        self.reduce_dtypes = {
            k: d for k, d in self.gather_dtypes.items() if reduce_in_compute and not is_shaped(k)
        }
        self.slices = {
            k: jax.ShapeDtypeStruct(self._slice_shape(shape, self.dims[k]), dtype_of(k))
            for k, shape in param_spec.shapes.items()
        }
        splits = [param_spec.split_of(k) if is_shaped(k) else None for k in self.slices]
        try:
            state = jax.eval_shape(optimizer.init, self.slices)
        except (ValueError, TypeError) as e:
            raise OptimizerError(
                "zero=True: the optimizer cannot run on slices of the parameters (it needs "
                "the parameter tree or whole leaves: a mask, per-leaf norms, factored "
                "moments); use an elementwise optimizer (adam, adamw, sgd) or zero=False: "
                f"{str(e).splitlines()[0]}"
            ) from e
        # Norms of the whole update (a global-norm clip): calls per update, and how.
        self.norm_calls = count_norm_calls(optimizer, self.slices, state)
        holders = shared.holders if shared is not None else {}
        self.norms = SliceNorms(self.dims, replicas, param_spec, held, holders)
        self.shared = shared
        opt_splits = opt_state_splits(optimizer, self.slices, splits)
        # Per chunk, (this replica's slice state, a copy of the next replica's): a
        # failed replica's slices survive on its neighbour (the module docstring).
        self.opt_spec = FlatSpec([(state, state)] * stages, splits=[opt_splits * 2] * stages)
        # ZeRO-3: the parameters between steps are (own slices, the next replica's) too.
        self.rows_spec = (
            FlatSpec([(self.slices, self.slices)] * stages, splits=[splits * 2] * stages)
            if level == 3
            else param_spec
        )

    def _slice_shape(self, shape: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
        if dim is None:
            return shape
        return tuple(n // self.D if d == dim else n for d, n in enumerate(shape))

    def scatter(self, grads: Buffers) -> Buffers:
        """(v, ...) gradient buffers -> summed over 'data', each replica its slice.
        Tied weights' gradients are summed over their holders first (shared.py)."""
        if self.shared is not None:
            grads = self.shared(grads, grads, first_replica_only=True)
        return {k: self._reduce(g, k, lead=1) for k, g in grads.items()}

    def zero_slices(self) -> Buffers:
        """One chunk's gradient slices, zeros: what `add_scattered` sums into."""
        return {k: jnp.zeros(a.shape, a.dtype) for k, a in self.slices.items()}

    def add_scattered(self, acc: Buffers, row: Buffers) -> Buffers:
        """One chunk's gradient slices `acc` plus this replica's slice of `row` (one
        chunk's gradient buffers, one microbatch's) summed over 'data': a buffer
        named in `reduce_dtypes` in that dtype, then widened (a bf16 sum over the
        replicas: half the bytes moved and no float32 copy of the row), the others
        in the slices' dtype. Every replica of the stage must call it together."""
        dtype = self.reduce_dtypes.get
        return {
            k: a + self._reduce(row[k].astype(dtype(k, a.dtype)), k, lead=0).astype(a.dtype)
            for k, a in acc.items()
        }

    def _reduce(self, g: jax.Array, k: str, lead: int) -> jax.Array:
        """Buffer `k` (after `lead` leading dimensions) summed over 'data': this
        replica's slice of it where it is cut, else the whole buffer."""
        if self.dims[k] is None:
            return over_devices(lax.psum, g, DATA)
        return lax.psum_scatter(g, DATA, scatter_dimension=lead + self.dims[k], tiled=True)

    def _like_slices(self, node: Any) -> bool:
        return jax.tree.structure(node, _masked) == jax.tree.structure(self.slices, _masked)

    def holder_rows(
        self,
        params: Buffers,
        stage_opts: list[Any] | None,
        held: list[int],
        spec: FlatSpec,
        replicas: list[int],
    ) -> Buffers:
        """Optax rows (holders, v, ...) of one position: holder h (replica
        replicas[h]) gets the state of its slices. params: the position's (v, ...)
        parameter rows; stage_opts: per chunk the stage's module-layout optax state
        (its parameter-shaped parts are cut into slices; other leaves are kept),
        or None for optimizer.init of the slices."""
        _, treedef = jax.tree.flatten(
            jax.eval_shape(self.optimizer.init, self.slices), self._like_slices
        )

        def state_of(c: int, s: int, r: int) -> Any:
            if stage_opts is None:
                return self.optimizer.init({k: self._take(b[c], k, r) for k, b in params.items()})
            like = _like(jax.tree.unflatten(spec.treedefs[s], spec.avals[s]))
            nodes = [
                {k: self._take(b, k, r) for k, b in spec.pack(s, node).items()}
                if like(node)
                else node
                for node in jax.tree.leaves(stage_opts[c], is_leaf=like)
            ]
            return treedef.unflatten(nodes)

        out = []
        for r in replicas:
            chunks = [
                self.opt_spec.pack(0, (state_of(c, s, r), state_of(c, s, (r + 1) % self.D)))
                for c, s in enumerate(held)
            ]
            out.append({k: jnp.stack([ch[k] for ch in chunks]) for k in chunks[0]})
        return {k: jnp.stack([o[k] for o in out]) for k in out[0]}

    def holder_param_rows(self, chunks: Buffers, replicas: list[int]) -> Buffers:
        """ZeRO-3: a position's (v, ...) whole parameter rows -> its holders' (holders,
        v, ...) rows of (own slices, the next replica's), holder h being replica
        replicas[h]."""
        v = next(iter(chunks.values())).shape[0]

        def part(c: int, r: int) -> Buffers:
            return {k: self._take(b[c], k, r % self.D) for k, b in chunks.items()}

        out = []
        for r in replicas:
            rows = [self.rows_spec.pack(0, (part(c, r), part(c, r + 1))) for c in range(v)]
            out.append({k: jnp.stack([row[k] for row in rows]) for k in rows[0]})
        return {k: jnp.stack([o[k] for o in out]) for k in out[0]}

    def whole_rows(self, params: Buffers, c: int, sources: list[tuple[int, int]]) -> Buffers:
        """ZeRO-3, the inverse of `holder_param_rows`: chunk c's whole parameter rows
        joined from the live holders' (holders, v, ...) rows, read as `sources` says."""
        parts = [
            self.rows_spec.unpack(0, {k: b[row, c] for k, b in params.items()})[half]
            for row, half in sources
        ]
        return {
            k: parts[0][k]
            if self.dims[k] is None
            else jnp.concatenate([p[k] for p in parts], axis=self.dims[k])
            for k in self.param_spec.sizes
        }

    def sources(self, live: list[int]) -> list[tuple[int, int]]:
        """Per replica h, where its slices are read from the rows of the live
        holders of a position (`live`: their replicas, in row order): (row, 0) its
        own, or (row, 1) the copy its previous replica keeps."""
        out = []
        for h in range(self.D):
            if h in live:
                out.append((live.index(h), 0))
            elif (h - 1) % self.D in live:
                out.append((live.index((h - 1) % self.D), 1))
            else:
                raise StateError(
                    f"zero={self.level}: replicas {h} and {(h - 1) % self.D} of a stage are "
                    f"both down, and with them both copies of replica {h}'s slices"
                )
        return out

    def stage_states(
        self, opt: Buffers, held: list[int], spec: FlatSpec, sources: list[tuple[int, int]]
    ) -> list[Any]:
        """The inverse of `holder_rows`: (live holders, v, ...) optax rows of one
        position -> per chunk its stage's module-layout optax state
        (`optimizer.init(stage params)`'s tree: the slices of each parameter-shaped
        part joined, read as `sources` says, and unpacked; other leaves from
        replica 0's)."""
        out = []
        for c, s in enumerate(held):
            states = [
                jax.tree.leaves(
                    self.opt_spec.unpack(0, {k: b[row, c] for k, b in opt.items()})[part],
                    is_leaf=self._like_slices,
                )
                for row, part in sources
            ]
            avals = jax.tree.unflatten(spec.treedefs[s], spec.avals[s])
            like = _like(avals)
            _, treedef = jax.tree.flatten(jax.eval_shape(self.optimizer.init, avals), like)
            nodes = []
            for i, node in enumerate(states[0]):
                if not self._like_slices(node):
                    nodes.append(node)
                    continue
                whole = {
                    k: b
                    if self.dims[k] is None
                    else jnp.concatenate([st[i][k] for st in states], axis=self.dims[k])
                    for k, b in node.items()
                }
                nodes.append(spec.unpack(s, whole))
            out.append(treedef.unflatten(nodes))
        return out

    def _take(self, buf: jax.Array, k: str, replica: Any) -> jax.Array:
        dim = self.dims[k]
        if dim is None:
            return buf
        n = buf.shape[dim] // self.D
        return lax.dynamic_slice_in_dim(buf, replica * n, n, axis=dim)

    def step(
        self, params: Buffers, grads: Buffers, opt: Buffers, pos: jax.Array
    ) -> tuple[Buffers, Buffers]:
        """This replica's optax update of its slices, then the parameters between steps
        (inside the program's shard_map). ZeRO-1: params are the (v, ...) whole rows,
        and the updated slices are all-gathered over 'data' once per step. ZeRO-3:
        params are the (v, ...) rows of (own slices, the next replica's copy), and
        the new own slices are sent to the previous replica for its copy. grads:
        `scatter`'s slices; opt: the (v, ...) optax rows; pos: this device's
        pipeline position."""
        r = lax.axis_index(DATA)
        v = next(iter(params.values())).shape[0]
        if self.level == 3:
            slices = self._own_slices(params)
        else:
            slices = [{k: self._take(b[c], k, r) for k, b in params.items()} for c in range(v)]
        new_p, opt = self._update(slices, grads, opt, pos)
        if self.level == 3:
            rows = [self.rows_spec.pack(0, (p, self._to_previous(p))) for p in new_p]
            return {k: jnp.stack([row[k] for row in rows]) for k in params}, opt
        return self._all_gather(new_p), opt

    def gather(self, params: Buffers) -> Buffers:
        """ZeRO-3: the (v, ...) rows of (own slices, copy) -> the whole (v, ...)
        parameter rows the tick loop reads, all-gathered over 'data' (once per step),
        each buffer in its compute dtype (`gather_dtypes`): the ops cast every leaf
        to it before use anyway, so the values they see are the same."""
        slices = [
            {k: b.astype(self.gather_dtypes.get(k, b.dtype)) for k, b in chunk.items()}
            for chunk in self._own_slices(params)
        ]
        return self._all_gather(slices)

    def _own_slices(self, params: Buffers) -> list[Buffers]:
        """ZeRO-3: per chunk, this replica's slices out of its (v, ...) parameter rows."""
        v = next(iter(params.values())).shape[0]
        return [self.rows_spec.unpack(0, {k: b[c] for k, b in params.items()})[0] for c in range(v)]

    def _all_gather(self, slices: list[Buffers]) -> Buffers:
        """Per chunk, {buffer key: this replica's slice} -> the whole (v, ...) rows,
        each buffer all-gathered over 'data' along its cut dimension."""
        out = {}
        for k in self.param_spec.sizes:
            b = jnp.stack([chunk[k] for chunk in slices])
            dim = self.dims[k]
            out[k] = b if dim is None else lax.all_gather(b, DATA, axis=1 + dim, tiled=True)
        return out

    def _to_previous(self, tree: Any) -> Any:
        """Each replica's `tree` on the previous replica (its copy of the next one's)."""
        shift = [(j, (j - 1) % self.D) for j in range(self.D)]
        return jax.tree.map(lambda a: lax.ppermute(a, DATA, shift), tree)

    def _update(
        self, slices: list[Buffers], grads: Buffers, opt: Buffers, pos: jax.Array
    ) -> tuple[list[Buffers], Buffers]:
        """optax on this replica's slices of each chunk: (new slices per chunk, the new
        optax rows with the copy of the next replica's state)."""
        r = lax.axis_index(DATA)
        v = len(slices)
        args = [
            (
                {k: b[c] for k, b in grads.items()},
                self.opt_spec.unpack(0, {k: b[c] for k, b in opt.items()})[0],
                slices[c],
            )
            for c in range(v)
        ]
        known = self.norms.known(
            self.norm_calls, lambda c: self.optimizer.update(*args[c]), v, pos, r
        )
        new_p: list[Buffers] = []
        new_o: list[Buffers] = []
        for c in range(v):
            g, o, p = args[c]
            with stage_norms(StageNorms(known, None)):
                updates, o = self.optimizer.update(g, o, p)
            new_p.append(optax.apply_updates(p, updates))
            # The copy of the next replica's new slice state, for failures.
            new_o.append(self.opt_spec.pack(0, (o, self._to_previous(o))))
        return new_p, {k: jnp.stack([o[k] for o in new_o]) for k in opt}
