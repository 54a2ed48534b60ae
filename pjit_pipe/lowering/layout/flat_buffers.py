"""Flat buffers for per-stage pytrees of different shapes.

SPMD needs one array shape on every device, but stages differ in parameter
shapes, activation shapes and residuals. A `FlatSpec` packs each of several
pytrees into one 1-D buffer per dtype, zero-padded to the largest of them, so a
stage's data can sit in a row of a shared buffer and be unpacked with static
slices inside the branch that knows which stage it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Buffers = dict[str, jax.Array]


def _leaf_aval(leaf: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))


class FlatSpec:
    """How each of `trees` maps into per-dtype flat buffers.

    With `dtype` given, every leaf is cast to that one dtype (one buffer);
    otherwise leaves are grouped by their own dtype. `sizes[key]` is the
    buffer length (at least 1, so empty groups still have a shape).
    """

    def __init__(self, trees: Sequence[Any], dtype: Any = None):
        self.treedefs = []
        self.avals: list[list[jax.ShapeDtypeStruct]] = []
        self.slots: list[list[tuple[str, int, int]]] = []
        sizes: dict[str, int] = {}
        for tree in trees:
            leaves, treedef = jax.tree.flatten(tree)
            avals = [_leaf_aval(leaf) for leaf in leaves]
            offsets: dict[str, int] = {}
            slots = []
            for a in avals:
                key = np.dtype(dtype if dtype is not None else a.dtype).name
                n = int(np.prod(a.shape, dtype=np.int64))
                start = offsets.get(key, 0)
                slots.append((key, start, n))
                offsets[key] = start + n
            for key, n in offsets.items():
                sizes[key] = max(sizes.get(key, 1), n)
            self.treedefs.append(treedef)
            self.avals.append(avals)
            self.slots.append(slots)
        if dtype is not None:
            sizes.setdefault(np.dtype(dtype).name, 1)
        self.sizes = dict(sorted(sizes.items()))

    def pack(self, i: int, tree: Any) -> Buffers:
        """Tree number `i` as flat buffers (every key of `sizes`, zero padded)."""
        leaves = jax.tree.leaves(tree)
        if len(leaves) != len(self.slots[i]):
            raise ValueError(f"tree {i}: {len(leaves)} leaves, expected {len(self.slots[i])}")
        return self.pack_leading(i, leaves, self.sizes)

    def pack_leading(self, i: int, leaves: Sequence[Any], widths: dict[str, int]) -> Buffers:
        """The first len(`leaves`) leaves of tree number `i` as flat buffers, each
        zero padded to `widths[key]` (the head of a row: the rest is written later)."""
        parts: dict[str, list[jax.Array]] = {k: [] for k in widths}
        for leaf, (key, _, _) in zip(leaves, self.slots[i][: len(leaves)], strict=True):
            parts[key].append(jnp.ravel(leaf).astype(key))
        out = {}
        for key, size in widths.items():
            flat = jnp.concatenate(parts[key]) if parts[key] else jnp.zeros((0,), key)
            out[key] = jnp.pad(flat, (0, size - flat.shape[0]))
        return out

    def same_shapes(self, trees: Iterable[int]) -> bool:
        """Whether these trees have one structure and the same leaf shapes and dtypes
        (their data may then stay trees: nothing to pack)."""
        return len({(self.treedefs[i], tuple(self.avals[i])) for i in trees}) == 1

    def unpack(self, i: int, bufs: Buffers) -> Any:
        """Tree number `i` back from flat buffers (static slices)."""
        leaves = [
            bufs[key][start : start + n].reshape(a.shape).astype(a.dtype)
            for (key, start, n), a in zip(self.slots[i], self.avals[i], strict=True)
        ]
        return jax.tree.unflatten(self.treedefs[i], leaves)

    def zeros(self, *lead: int) -> Buffers:
        """Empty buffers with leading dimensions `lead`."""
        return {k: jnp.zeros((*lead, n), k) for k, n in self.sizes.items()}
