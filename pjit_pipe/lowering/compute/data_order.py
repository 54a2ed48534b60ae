"""Ordering XLA's in-place writes after reads, by data dependence alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pjit_pipe.lowering.layout.flat_buffers import Buffers


def after(token: Buffers, index: jax.Array) -> jax.Array:
    """`index`, computed from `token` as well, so that XLA runs what uses it after
    whatever made `token` (it orders ops by data dependence only).

    Under the lane order B, W, F the tick's F writes residual slots that its B, W
    and BW have just read (their conds take the stores as read-only operands).
    Unless F's in-place writes depend on those conds, XLA cannot tell that the
    reads come first and copies the whole residual store on every tick. F's slot
    indices are therefore made to depend on the gradient message, the output of
    the B and W lanes: max(index, -|bits of one element|) is `index` exactly
    (an index is >= 0, the other side <= 0), whatever the element holds, NaN
    included, and XLA does not fold it away (an optimization_barrier or a
    pass-through output does not survive to its copy insertion)."""
    leaf = jnp.ravel(jax.tree.leaves(token)[0])[0]
    if jnp.iscomplexobj(leaf):
        leaf = leaf.real
    if jnp.issubdtype(leaf.dtype, jnp.floating):  # its bits: no NaN to convert
        leaf = lax.bitcast_convert_type(leaf, jnp.dtype(f"int{leaf.dtype.itemsize * 8}"))
    return lax.max(index, -lax.abs(leaf.astype(jnp.int32)))
