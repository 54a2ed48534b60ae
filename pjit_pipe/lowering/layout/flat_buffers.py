"""Flat buffers for per-stage pytrees of different shapes.

SPMD needs one array shape on every device, but stages differ in parameter
shapes, activation shapes and residuals. A `FlatSpec` packs each of several
pytrees into one 1-D buffer per dtype, zero-padded to the largest of them, so a
stage's data can sit in a row of a shared buffer and be unpacked with static
slices inside the branch that knows which stage it is.

A leaf split over the mesh's 'tensor' axis (`splits`) cannot sit in a flat
row: one row is one sharding, and leaves split on different dimensions need
different ones (docs/tensor_parallel.md). Such a leaf gets a *shaped* buffer
of its own, keyed by its dtype, shape, split and occurrence ("float32|64x256|
None,tensor|0"): the buffer has the leaf's shape, so each device keeps its
slice of it, and the stages with a leaf of the same key share the buffer (a
stage without one leaves it at zero).

A flat row that holds values split over 'tensor' without being one of them
(the residual pools, stages.py: a column-parallel matmul's output among
replicated activations) is `replicated`: each leaf is pinned replicated over
'tensor' where it enters and leaves the row. Left to itself XLA shards such a
row over 'tensor' like the values in it, and a static slice of a sharded row
at an offset that is no multiple of its shard length is resharded by
collective-permutes, inside the branch of the one stage that reads it
(docs/tensor_parallel.md). Replicated, the pins cost an all-gather over the
tensor group where a split value enters the row, and a local slice where it
leaves.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as PS

Buffers = dict[str, jax.Array]
Split = tuple[str | None, ...]  # per dimension, 'tensor' or None


def dtype_of(key: str) -> str:
    """The dtype name of a buffer key (flat, shaped, a size class "float32#4096#0",
    or a flat row of its own: "float32+1", row_optimizer.py)."""
    return key.split("|", 1)[0].split("+", 1)[0].split("#", 1)[0]


def is_shaped(key: str) -> bool:
    """Whether the key names a shaped buffer (one leaf split over 'tensor')."""
    return "|" in key


def replicated(tree: Any) -> Any:
    """`tree` with every leaf pinned replicated over the auto 'tensor' axis (inside
    the program's shard_map, which is manual over the worker axes)."""
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, PS()), tree)


def _leaf_aval(leaf: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))


class FlatSpec:
    """How each of `trees` maps into per-dtype flat buffers.

    With `dtype` given, every leaf is cast to that one dtype (one buffer);
    otherwise leaves are grouped by their own dtype. `sizes[key]` is the
    buffer's elements (a flat row's length: at least 1, so empty groups still
    have a shape), `shapes[key]` its shape and `splits[key]` how a shaped
    buffer splits over 'tensor'. `splits` (optional): per tree, per leaf, its
    split or None (replicated: it goes into a flat row). `multiple`: flat rows
    are padded to a multiple of it (ZeRO's D slices, zero.py). `replicated`:
    each leaf is pinned replicated over 'tensor' as it is packed and unpacked
    (module docstring); only inside the program's shard_map. `classes`: each
    leaf that would sit in a flat row gets a flat row of its own instead, a
    *size class* keyed by dtype, element count and occurrence
    ("float32#4096#0": the first leaf of 4096 float32s in its tree), which
    the trees with such a leaf share (`without_classes` is the layout it replaces);
    a mapping {(dtype name, elements): k} gives only the first k leaves of each
    size in each tree a class, and the rest stay in the flat row (`compact_classes`).
    `self.classes`: whether every leaf outside a shaped buffer has a class.
    """

    def __init__(
        self,
        trees: Sequence[Any],
        dtype: Any = None,
        splits: Sequence[Sequence[Split | None]] | None = None,
        multiple: int = 1,
        replicated: bool = False,
        classes: bool | Mapping[tuple[str, int], int] = False,
    ):
        self.replicated = replicated
        self._options = {"dtype": dtype, "multiple": multiple}  # for without_classes
        self.treedefs = []
        self.avals: list[list[jax.ShapeDtypeStruct]] = []
        self.slots: list[list[tuple[str, int, int]]] = []
        sizes: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.splits: dict[str, Split] = {}
        for i, tree in enumerate(trees):
            leaves, treedef = jax.tree.flatten(tree)
            avals = [_leaf_aval(leaf) for leaf in leaves]
            split = splits[i] if splits is not None else [None] * len(avals)
            offsets: dict[str, int] = {}
            seen: dict[Any, int] = {}  # a shaped key's or a (dtype, size)'s leaves so far
            slots = []
            for a, how in zip(avals, split, strict=True):
                key = np.dtype(dtype if dtype is not None else a.dtype).name
                n = int(np.prod(a.shape, dtype=np.int64))
                if how is not None and "tensor" in how:
                    base = "|".join((key, "x".join(map(str, a.shape)), ",".join(map(str, how))))
                    j = seen[base] = seen.get(base, -1) + 1
                    shaped = f"{base}|{j}"
                    slots.append((shaped, 0, n))
                    sizes[shaped], self.shapes[shaped], self.splits[shaped] = n, a.shape, how
                    continue
                j = seen.get((key, n), 0)
                seen[key, n] = j + 1
                if classes is True or (classes and j < classes.get((key, n), 0)):
                    key = f"{key}#{n}#{j}"
                start = offsets.get(key, 0)
                slots.append((key, start, n))
                offsets[key] = start + n
            for key, n in offsets.items():
                sizes[key] = max(sizes.get(key, 1), -(-n // multiple) * multiple)
            self.treedefs.append(treedef)
            self.avals.append(avals)
            self.slots.append(slots)
        if dtype is not None:
            sizes.setdefault(np.dtype(dtype).name, multiple)
        self.sizes = dict(sorted(sizes.items()))
        for key, n in self.sizes.items():
            self.shapes.setdefault(key, (n,))
        self.shapes = {k: self.shapes[k] for k in self.sizes}
        self.classes = bool(classes) and all(
            is_shaped(key) or "#" in key for slots in self.slots for key, _, _ in slots
        )

    @classmethod
    def compact_classes(cls, trees: Sequence[Any], max_overhead: float, **options: Any) -> FlatSpec:
        """`trees` with as many leaves in size classes as fit in `max_overhead`
        times the bytes of the flat layout, the largest sizes first (`options` as
        for `FlatSpec`). Even at 1.0 many leaves fit where the trees share sizes:
        a class costs nothing when every tree whose leaves fill a flat row (the
        longest) has a leaf of its size, since that tree's row shrinks by what
        the class holds. A class's cost never falls as it takes more leaves, so
        the fill stops at the first one over the limit."""
        flat = cls(trees, **options)
        multiple = options.get("multiple", 1)
        padded = lambda n: -(-n // multiple) * multiple  # noqa: E731
        # Per tree, its leaves per (dtype name, elements) outside shaped buffers.
        per_tree = [
            collections.Counter((key, n) for key, _, n in slots if not is_shaped(key))
            for slots in flat.slots
        ]
        most = {size: max(c[size] for c in per_tree) for c in per_tree for size in c}

        def nbytes(counts: dict[tuple[str, int], int]) -> int:
            """Bytes of the classes `counts` and of the flat rows left beside them."""
            classes = sum(k * padded(n) * np.dtype(d).itemsize for (d, n), k in counts.items())
            rows: dict[str, int] = {}
            for tree in per_tree:
                left: dict[str, int] = {}
                for (d, n), k in tree.items():
                    left[d] = left.get(d, 0) + max(0, k - counts.get((d, n), 0)) * n
                for d, elements in left.items():
                    rows[d] = max(rows.get(d, 0), elements)
            return classes + sum(padded(e) * np.dtype(d).itemsize for d, e in rows.items() if e)

        # Shaped buffers are the same in every trial: the limit leaves room for them.
        # Shaped buffers are the same in every trial: the limit leaves room for them.
        whole = flat.total_bytes()
        limit = max_overhead * whole - (whole - nbytes({}))
        counts: dict[tuple[str, int], int] = {}
        for size in sorted(most, key=lambda size: -size[1]):
            for k in range(1, most[size] + 1):
                if nbytes({**counts, size: k}) > limit:
                    break
                counts[size] = k
        return cls(trees, classes=counts, **options) if counts else flat

    def without_classes(self) -> FlatSpec:
        """The same trees in one flat row per dtype: the layout `classes` replaces
        (a class holds the most leaves of its size that any tree has, so trees that
        share few sizes pay for each other's; `total_bytes` of both says how much)."""
        return FlatSpec(
            [jax.tree.unflatten(t, a) for t, a in zip(self.treedefs, self.avals, strict=True)],
            splits=[[self.splits.get(k) for k, _, _ in slots] for slots in self.slots],
            **self._options,
        )

    def total_bytes(self) -> int:
        """Bytes of all buffers without leading dimensions."""
        return sum(self.nbytes(key) for key in self.sizes)

    def split_of(self, key: str) -> Split:
        """How buffer `key` splits over 'tensor' after its leading dimensions (a flat
        row: not at all)."""
        return self.splits.get(key, (None,))

    @property
    def tensor_split(self) -> bool:
        """Whether any leaf is split over 'tensor' (has a shaped buffer)."""
        return bool(self.splits)

    def pack(self, i: int, tree: Any) -> Buffers:
        """Tree number `i` as flat buffers (every key of `sizes`, zero padded)."""
        return {
            key: got[0] if is_shaped(key) else jnp.concatenate(got)
            for key, got in self.pieces(i, tree).items()
        }

    def pieces(self, i: int, tree: Any) -> dict[str, list[jax.Array]]:
        """Per key of `sizes`, what `pack(i, tree)` concatenates into its buffer: the
        raveled leaves in order, then the zero padding (a shaped buffer: itself).
        A caller that packs several trees into one row concatenates all their
        pieces at once: a concatenate of packed rows is a second row-long pass."""
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.slots[i]):
            raise ValueError(f"tree {i}: {len(leaves)} leaves, expected {len(self.slots[i])}")
        parts: dict[str, list[jax.Array]] = {k: [] for k in self.sizes}
        for leaf, (key, _, _) in zip(leaves, self.slots[i], strict=True):
            if is_shaped(key):
                parts[key].append(jnp.asarray(leaf).astype(dtype_of(key)))
            else:
                parts[key].append(jnp.ravel(self._pinned(leaf)).astype(dtype_of(key)))
        for key, size in self.sizes.items():
            if is_shaped(key):
                if not parts[key]:
                    parts[key].append(jnp.zeros(self.shapes[key], dtype_of(key)))
                continue
            pad = size - sum(part.shape[0] for part in parts[key])
            if pad or not parts[key]:
                parts[key].append(jnp.zeros((pad,), dtype_of(key)))
        return parts

    def write(
        self, i: int, stores: Buffers, slot: Any, leaves: Sequence[Any], first: int = 0
    ) -> Buffers:
        """Leaves `first`, `first` + 1, ... of tree number `i` (`leaves`) written into
        row `slot` of `stores` ((slots, *shape) per key), leaf by leaf at their
        offsets, in place. No packed row is built: that would be a concatenate of every leaf
        (a slow kernel on GPUs when the leaves are many) and then a copy of it into
        the store. The rest of the row keeps what it held; readers read only their
        tree's slots."""
        out = dict(stores)
        slots = self.slots[i][first : first + len(leaves)]
        for leaf, (key, start, _) in zip(leaves, slots, strict=True):
            if is_shaped(key):
                value = jnp.asarray(leaf).astype(dtype_of(key))
                at = (0,) * value.ndim
            else:
                value, at = jnp.ravel(self._pinned(leaf)).astype(dtype_of(key)), (start,)
            out[key] = lax.dynamic_update_slice(out[key], value[None], (slot, *at))
        return out

    def same_shapes(self, trees: Iterable[int]) -> bool:
        """Whether these trees have one structure and the same leaf shapes and dtypes
        (their data may then stay trees: nothing to pack)."""
        return len({(self.treedefs[i], tuple(self.avals[i])) for i in trees}) == 1

    def unpack(self, i: int, bufs: Buffers) -> Any:
        """Tree number `i` back from flat buffers (static slices)."""
        leaves = [
            bufs[key].astype(a.dtype)
            if is_shaped(key)
            else self._pinned(bufs[key][start : start + n].reshape(a.shape).astype(a.dtype))
            for (key, start, n), a in zip(self.slots[i], self.avals[i], strict=True)
        ]
        return jax.tree.unflatten(self.treedefs[i], leaves)

    def _pinned(self, leaf: Any) -> Any:
        """A leaf entering or leaving a flat row: pinned replicated over 'tensor'
        when the rows are `replicated`."""
        return replicated(leaf) if self.replicated else leaf

    def zeros(self, *lead: int) -> Buffers:
        """Empty buffers with leading dimensions `lead`."""
        return {k: jnp.zeros((*lead, *self.shapes[k]), dtype_of(k)) for k in self.sizes}

    def nbytes(self, key: str) -> int:
        """Bytes of one (unsplit) buffer `key` without leading dimensions."""
        return self.sizes[key] * np.dtype(dtype_of(key)).itemsize
