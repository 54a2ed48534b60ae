"""Which buffers of a stage's parameters and optax state are split over 'tensor'.

The frontend reads each weight's split from the model's annotations
(frontend/cutter/tensor_split.py) and hands the lowering, per virtual stage, one
entry per parameter leaf: its per-dimension split, or None (replicated).
The optax state splits the same way: a parameter-shaped subtree of it (adam's
mu and nu, momentum traces) mirrors the parameters leaf by leaf, and any other
leaf (a step count) is replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

from pjit_pipe.lowering.layout.flat_buffers import Split

LeafSplits = list[Split | None]


def _masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


def opt_state_splits(
    optimizer: optax.GradientTransformation, params: Any, splits: LeafSplits
) -> LeafSplits:
    """Per leaf of `optimizer.init(params)`, its split (see the module docstring)."""
    state = jax.eval_shape(optimizer.init, params)
    treedef = jax.tree.structure(params, _masked)

    def like(node: Any) -> bool:
        return jax.tree.structure(node, _masked) == treedef

    out: LeafSplits = []
    for node in jax.tree.leaves(state, is_leaf=like):
        if like(node) and not _masked(node):
            out += [
                h
                for h, leaf in zip(splits, jax.tree.leaves(node, is_leaf=_masked), strict=True)
                if not _masked(leaf)
            ]
        else:
            out += [None] * len(jax.tree.leaves(node))
    return out


def any_split(splits: Sequence[LeafSplits] | None) -> bool:
    """Whether some leaf of some stage is split over 'tensor'."""
    return bool(splits) and any(h is not None for stage in splits for h in stage)
