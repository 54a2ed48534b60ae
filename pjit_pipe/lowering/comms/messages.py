"""What crosses a stage boundary: activations down, their cotangents up.

A boundary is any pytree of arrays (a hidden state, a `(hidden, mask)` pair,
integer positions). Messages travel in one flat buffer per dtype, each sized
for the largest boundary that uses that dtype, so a bool mask is not widened
to float and a float tensor is not rounded to an integer type. A cotangent
message carries only the inexact leaves: integer and boolean leaves take no
gradient, and the pullback gets JAX's float0 zeros for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec


def _differentiable(a: Any) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


class MessageSpec:
    """Flat per-dtype message buffers for the boundaries between S stages.

    boundaries[s]: the avals of stage s's output (the input of stage s+1),
    s = 0..S-2. Tree s of the underlying FlatSpec is boundary s's activation,
    tree S-1+s its cotangent (the inexact leaves only).
    """

    def __init__(self, boundaries: Sequence[Any]):
        self.boundaries = list(boundaries)
        self.n = len(self.boundaries)
        grads = [[a for a in jax.tree.leaves(b) if _differentiable(a)] for b in self.boundaries]
        self.spec = FlatSpec([*self.boundaries, *grads] or [jnp.zeros((), jnp.float32)])

    @property
    def sizes(self) -> dict[str, int]:
        return self.spec.sizes

    def zeros(self, *lead: int) -> Buffers:
        return self.spec.zeros(*lead)

    def pack_act(self, s: int, tree: Any) -> Buffers:
        """Stage s's output as a message."""
        return self.spec.pack(s, tree)

    def unpack_act(self, s: int, bufs: Buffers) -> Any:
        """Stage s's output back from a message."""
        return self.spec.unpack(s, bufs)

    def pack_grad(self, s: int, cotangent: Any) -> Buffers:
        """The cotangent of boundary s (a tree like it, float0 where not inexact)."""
        leaves = jax.tree.leaves(cotangent)
        avals = jax.tree.leaves(self.boundaries[s])
        return self.spec.pack(
            self.n + s, [g for g, a in zip(leaves, avals, strict=True) if _differentiable(a)]
        )

    def unpack_grad(self, s: int, bufs: Buffers) -> Any:
        """The cotangent of boundary s as the pullback takes it."""
        inexact = iter(self.spec.unpack(self.n + s, bufs))
        avals, treedef = jax.tree.flatten(self.boundaries[s])
        leaves = [
            next(inexact) if _differentiable(a) else np.zeros(a.shape, jax.dtypes.float0)
            for a in avals
        ]
        return jax.tree.unflatten(treedef, leaves)


def read_rows(store: Buffers, slots: list) -> list[Buffers]:
    """The message rows at `slots` of `store`, read in one gather per dtype."""
    read = {k: jnp.take(b, jnp.stack(slots), axis=0, mode="clip") for k, b in store.items()}
    return [{k: r[i] for k, r in read.items()} for i in range(len(slots))]
