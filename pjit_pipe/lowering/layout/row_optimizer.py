"""The optax step on whole flat rows, for updates that treat every element alike.

The per-leaf step (optimizer.py) cuts each held stage's parameter tree and
optax state out of the device's rows, runs optax, and packs the result back,
inside a switch on the pipeline position. XLA then compiles each leaf's
update as kernels of their own (a kernel bakes in its slice offsets), and
every stage layout has its own branch: on the tiny GPT that was most of the
program's optimizer kernels (benchmarks/bench_kernels.py).

When the update is leafwise (leafwise.py: one elementwise rule for every
element of every leaf, as adam, adamw, sgd and momentum are) it runs once
per parameter buffer (a size class or a dtype's flat row) on the whole row
instead, the same on every position, so no switch, and rows of one size
share their kernels and their trace. For that the optax state's rows are
laid out in step with the parameter rows: the state of `optimizer.init(row)`
(the row tree, {buffer key: (L,)}) is packed as usual, and each stage's own state
(`optimizer.init(stage tree)`, the module layout the device layout converts
to and from) sits inside it, each parameter-shaped part at its parameters'
offsets in that part's row-long region. A row's padding holds zeros in and
whatever the rule makes of zeros out; no stage's leaf reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from pjit_pipe.lowering.compute.replay import TracedOnce
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, dtype_of
from pjit_pipe.lowering.layout.leafwise import leafwise, like


class RowOptimizer:
    """One optax step per dtype row (see the module docstring); build with `fit`.

    `spec` is the optax state's row layout: `spec.pack(s, state)` and
    `spec.unpack(s, rows)` convert stage s's own optax state, as a per-stage
    FlatSpec does, and `state_spec` reads the whole-row state from the rows.
    """

    def __init__(
        self, optimizer: optax.GradientTransformation, spec: FlatSpec, state_spec: FlatSpec
    ):
        self.optimizer = optimizer
        self.spec = spec
        self.state_spec = state_spec
        # Per number of leading dimensions: `_step_row` mapped over them, jitted; its
        # trace is made once per row signature for every program (replay.py), so a
        # failure variant does not vmap and trace the optax rule again.
        self._row_steps: dict[int, Callable] = {}

    def _step_row(
        self, p: jax.Array, g: jax.Array, old: Any, keep: jax.Array | None
    ) -> tuple[jax.Array, Any]:
        """One row's (new parameters, new optax state), the state's parameter-shaped
        nodes cut to this row. With `keep` false the old values stay."""
        new = optax.apply_updates(p, self.optimizer.update(g, old, p)[0])
        if keep is not None:
            new = jnp.where(keep, new, p)
        # The state is stepped apart, after the parameters: their kernel reads the
        # old state, the state's kernels then overwrite it in place (in one pass
        # XLA may fuse the state's rule into the parameters' kernel as well, and
        # then copies the old state to keep it for that kernel; the XLA of jaxlib
        # 0.10 copies it either way).
        new, old = lax.optimization_barrier((new, old))
        state = self.optimizer.update(g, old, p)[1]
        if keep is not None:
            state = jax.tree.map(lambda n, o: jnp.where(keep, n, o), state, old)
        return new, state

    @classmethod
    def fit(
        cls, optimizer: optax.GradientTransformation, param_spec: FlatSpec
    ) -> RowOptimizer | None:
        """The row step for parameters laid out by `param_spec`, or None where the
        update must run leaf by leaf: leaves split over 'tensor' (shaped buffers),
        an update that is not leafwise, or a stage whose optax state is not the
        row state's in shape."""
        try:
            return _fitted(optimizer, _Layout(param_spec))
        except TypeError:  # an optimizer that cannot be a cache key
            return (
                None if why_not_rows(optimizer, param_spec) else cls._build(optimizer, param_spec)
            )

    @classmethod
    def _build(cls, optimizer: optax.GradientTransformation, param_spec: FlatSpec) -> RowOptimizer:
        row = _row(param_spec)
        state = jax.eval_shape(optimizer.init, row)
        is_row = like(row)
        state_spec = _row_state_spec(state, is_row)
        # Per node of the row state: its slot, or per parameter key (in the sorted order
        # jax flattens a dict in) its region's slot.
        slots = iter(state_spec.slots[0])
        regions = [
            {k: next(slots) for k in sorted(node)} if is_row(node) else next(slots)
            for node in jax.tree.leaves(state, is_leaf=is_row)
        ]
        treedefs, avals, placed = [], [], []
        for s, params in enumerate(_stage_trees(param_spec)):
            own = jax.eval_shape(optimizer.init, params)
            is_params = like(params)
            at = []
            for node, region in zip(jax.tree.leaves(own, is_leaf=is_params), regions, strict=True):
                if not is_params(node):
                    at.append(region)
                    continue
                for (key, offset, n), _ in zip(
                    param_spec.slots[s], jax.tree.leaves(node), strict=True
                ):
                    dtype, base, _ = region[key]
                    at.append((dtype, base + offset, n))
            treedefs.append(jax.tree.structure(own))
            avals.append(jax.tree.leaves(own))
            placed.append(at)
        return cls(optimizer, _PlacedSpec(treedefs, avals, placed, state_spec.sizes), state_spec)

    def step(
        self, params: Buffers, grads: Buffers, opt: Buffers, keep: jax.Array | None = None
    ) -> tuple[Buffers, Buffers]:
        """(new parameter rows, new optax rows) from parameter, gradient and optax
        rows of shape (..., L): every chunk's update at once, whatever stage it
        holds.

        With `keep` (a bool, one for every chunk or one per chunk) each chunk's new
        values are taken only where it is true, else the old ones (the non-finite
        check, step.py; the chunks that step in a tick of the stepping loop): the
        choice is made inside the update's own kernels. Given the program's own buffers
        (their leading dimensions too: a row cut out of them by rank is a
        bitcast that stops XLA from writing in place), each kernel writes its
        row over the donated one: no copy, no row-long temporary (on a CPU a
        fresh row-long buffer also costs its page faults, every step)."""

        lead = next(iter(params.values())).shape[:-1]  # (..., v): a row per chunk
        if keep is not None:
            # Made once, behind a barrier: XLA would otherwise fuse the verdict's
            # computation (the whole gradient's norm) into every row's kernel, with
            # its operands in a different order in each, so that rows of one size
            # no longer share one compiled kernel.
            keep = lax.optimization_barrier(jnp.broadcast_to(keep, lead))
        if len(lead) not in self._row_steps:
            row_step = self._step_row
            for _ in lead:  # every chunk's rows at once, in their own shapes
                row_step = jax.vmap(row_step)
            self._row_steps[len(lead)] = jax.jit(TracedOnce(row_step))
        row_step = self._row_steps[len(lead)]
        with jax.named_scope("OPT rows"):  # metadata only: see tick_ops._named
            # The row state's nodes: parameter-shaped ones ({key: row}) and the
            # shared scalars (a step count). Each row steps alone, its nodes cut to
            # its own row: the rule is leafwise, so that is the same update, and
            # rows of one shape share one trace (`row_step` is jitted).
            is_row = like(params)
            nodes, treedef = jax.tree.flatten(self.state_spec.unpack(0, opt, lead), is_leaf=is_row)
            stepped = {}
            for k in params:
                own = treedef.unflatten([n[k] if is_row(n) else n for n in nodes])
                new, state = row_step(params[k], grads[k], own, keep)
                stepped[k] = new, treedef.flatten_up_to(state)
            first = next(iter(stepped.values()))[1]  # the scalars: the same from every row
            state = treedef.unflatten(
                [
                    {k: got[i] for k, (_, got) in stepped.items()} if is_row(n) else first[i]
                    for i, n in enumerate(nodes)
                ]
            )
            return {k: new for k, (new, _) in stepped.items()}, self.state_spec.pack(0, state, lead)


class _PlacedSpec(FlatSpec):
    """A FlatSpec of flat rows whose leaves sit where `slots` says (per tree, per
    leaf: buffer key, start, elements) in buffers of `sizes` elements, with gaps
    between them, instead of one after another: each stage's optax state inside
    the row state (the module docstring)."""

    def __init__(
        self,
        treedefs: list[Any],
        avals: list[list[jax.ShapeDtypeStruct]],
        slots: list[list[tuple[str, int, int]]],
        sizes: dict[str, int],
    ):
        self.treedefs, self.avals, self.slots = treedefs, avals, slots
        self.sizes = dict(sorted(sizes.items()))
        self.shapes = {k: (n,) for k, n in self.sizes.items()}
        self.splits = {}
        self.replicated = False  # no split leaves: the row step is refused with them (why_not_rows)

    def pack(self, i: int, tree: Any, lead: tuple[int, ...] = ()) -> Buffers:
        """Tree number `i` as flat rows: each leaf at its slot, zeros elsewhere. With
        `lead`, every leaf has those leading dimensions first, and so do the rows."""
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.slots[i]):
            raise ValueError(f"tree {i}: {len(leaves)} leaves, expected {len(self.slots[i])}")
        out = {}
        for key, size in self.sizes.items():
            dtype = dtype_of(key)
            placed = sorted(
                (
                    (start, n, jnp.reshape(leaf, (*lead, n)).astype(dtype))
                    for leaf, (k, start, n) in zip(leaves, self.slots[i], strict=True)
                    if k == key
                ),
                key=lambda part: part[0],
            )
            pieces, end = [], 0
            for start, n, flat in placed:
                if start > end:
                    pieces.append(jnp.zeros((*lead, start - end), dtype))
                pieces.append(flat)
                end = start + n
            if size > end:
                pieces.append(jnp.zeros((*lead, size - end), dtype))
            out[key] = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)
        return out

    def unpack(self, i: int, bufs: Buffers, lead: tuple[int, ...] = ()) -> Any:
        """Tree number `i` back from flat rows with leading dimensions `lead`."""
        leaves = [
            bufs[key][..., start : start + n].reshape(*lead, *a.shape).astype(a.dtype)
            for (key, start, n), a in zip(self.slots[i], self.avals[i], strict=True)
        ]
        return jax.tree.unflatten(self.treedefs[i], leaves)


def _row_state_spec(state: Any, is_row: Any) -> _PlacedSpec:
    """The row state's layout: each leaf of a parameter-shaped node (one per
    parameter dtype: adam's mu, nu) in a row buffer of its own, keyed
    "<dtype>+<n>", so the step's elementwise kernels update it in place (a
    row holding several would be rebuilt by a concatenate, and XLA copies a
    donated buffer that a kernel both slices and rewrites); the other leaves (a
    step count) packed one after another into a "<dtype>" row."""
    slots: list[tuple[str, int, int]] = []
    sizes: dict[str, int] = {}
    own: dict[str, int] = {}  # per dtype, row buffers so far
    for node in jax.tree.leaves(state, is_leaf=is_row):
        for leaf in jax.tree.leaves(node):
            dtype, n = np.dtype(leaf.dtype).name, int(np.prod(leaf.shape, dtype=np.int64))
            if is_row(node):
                key = f"{dtype}+{own.get(dtype, 0)}"
                own[dtype] = own.get(dtype, 0) + 1
                slots.append((key, 0, n))
                sizes[key] = n
            else:
                slots.append((dtype, sizes.get(dtype, 0), n))
                sizes[dtype] = sizes.get(dtype, 0) + n
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(state)]
    return _PlacedSpec([jax.tree.structure(state)], [avals], [slots], sizes)


class _Layout:
    """A FlatSpec compared by its layout: the failure variants of one pipeline make
    equal specs, and `_fitted` answers them from one trace."""

    def __init__(self, spec: FlatSpec):
        self.spec = spec
        self.key = (
            tuple(spec.treedefs),
            tuple(tuple(a) for a in spec.avals),
            tuple(tuple(s) for s in spec.slots),
            tuple(spec.sizes.items()),
            tuple(spec.splits.items()),
        )

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Layout) and self.key == other.key


@functools.lru_cache(maxsize=16)
def _fitted(optimizer: optax.GradientTransformation, layout: _Layout) -> RowOptimizer | None:
    if why_not_rows(optimizer, layout.spec):
        return None
    return RowOptimizer._build(optimizer, layout.spec)


def _row(param_spec: FlatSpec) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((n,), dtype_of(k)) for k, n in param_spec.sizes.items()}


def _stage_trees(param_spec: FlatSpec) -> list[Any]:
    return [
        jax.tree.unflatten(treedef, avals)
        for treedef, avals in zip(param_spec.treedefs, param_spec.avals, strict=True)
    ]


def why_not_rows(optimizer: optax.GradientTransformation, param_spec: FlatSpec) -> str | None:
    """None when `RowOptimizer.fit` takes the row step for this layout, else why not."""
    if param_spec.tensor_split:
        return "leaves split over 'tensor' have buffers of their own"
    try:
        return _row_mismatch(optimizer, param_spec)
    except Exception as e:  # the per-leaf step then reports it in its own words
        return f"the update does not trace on a row: {type(e).__name__}"


def _row_mismatch(optimizer: optax.GradientTransformation, param_spec: FlatSpec) -> str | None:
    row = _row(param_spec)
    trees = _stage_trees(param_spec)
    # One stage of each parameter layout (same-shaped stages give the same answers).
    firsts = list(
        {
            (t, tuple(a)): s
            for s, (t, a) in enumerate(zip(param_spec.treedefs, param_spec.avals, strict=True))
        }.values()
    )
    why = leafwise(optimizer, [trees[s] for s in firsts], row)
    if why is not None:
        return why
    state = jax.eval_shape(optimizer.init, row)
    is_row = like(row)
    nodes = jax.tree.leaves(state, is_leaf=is_row)
    other = "a stage's optax state is not shaped like the row's"
    for s in firsts:
        own = jax.eval_shape(optimizer.init, trees[s])
        is_params = like(trees[s])
        if jax.tree.structure(own, is_leaf=is_params) != jax.tree.structure(state, is_leaf=is_row):
            return other
        for mine, theirs in zip(jax.tree.leaves(own, is_leaf=is_params), nodes, strict=True):
            if is_params(mine) != is_row(theirs):
                return other
            if not is_params(mine):
                if (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
                    return other
                continue
            leaves = zip(
                jax.tree.leaves(mine), param_spec.avals[s], param_spec.slots[s], strict=True
            )
            for leaf, param, (key, _, _) in leaves:
                if (leaf.shape, leaf.dtype) != (param.shape, theirs[key].dtype):
                    return other
    return None
