"""Optimizer state in the module's own layout, converted to and from the stages'.

Users (and checkpoints) hold `optimizer.init(params)` for the model's whole
parameter tree, so a saved state does not depend on the pipeline's cut. The
lowering steps each stage with its own optax state, `optimizer.init(stage
params)`. An optax state is a tree whose parameter-shaped subtrees (adam's mu
and nu, momentum traces) mirror the parameters, next to stage-independent
leaves (step counts); a stage's state is the same tree with each
parameter-shaped subtree cut down to that stage's units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from pjit_pipe.errors import OptimizerError
from pjit_pipe.frontend.cutter.cut import StageCut


def _masked(node: Any) -> bool:
    """optax.masked puts MaskedNode where a parameter is masked out: a leaf here."""
    return isinstance(node, optax.MaskedNode)


def _shaped_like(tree: Any) -> Callable[[Any], bool]:
    treedef = jax.tree.structure(tree, _masked)
    return lambda node: jax.tree.structure(node, _masked) == treedef


def split_opt_state(cut: StageCut, state: Any, params: Any) -> list[Any]:
    """The module-layout state of `params` -> one optax state per stage."""
    like = _shaped_like(params)
    leaves, treedef = jax.tree.flatten(state, is_leaf=like)
    per_leaf = [cut.split(a, _masked) if like(a) else [a] * cut.stages for a in leaves]
    return [treedef.unflatten([parts[s] for parts in per_leaf]) for s in range(cut.stages)]


def merge_opt_state(cut: StageCut, stage_states: Sequence[Any], template: Any, params: Any) -> Any:
    """Inverse of `split_opt_state`; `template` is a module-layout state (or its
    shapes) that gives the tree, and stage-independent leaves come from stage 0."""
    like = _shaped_like(params)
    template_leaves, treedef = jax.tree.flatten(template, is_leaf=like)
    per_stage = [
        jax.tree.leaves(st, is_leaf=_shaped_like(p))
        for st, p in zip(stage_states, cut.split(params), strict=True)
    ]
    merged = [
        cut.merge([leaves[i] for leaves in per_stage]) if like(t) else per_stage[0][i]
        for i, t in enumerate(template_leaves)
    ]
    return treedef.unflatten(merged)


def check_opt_layout(cut: StageCut, optimizer: optax.GradientTransformation, params: Any) -> None:
    """Raise if this optimizer's state does not split into the stages' states (a
    state whose per-parameter parts are not shaped like the parameters)."""
    whole = jax.eval_shape(optimizer.init, params)
    try:
        want = [jax.tree.structure(jax.eval_shape(optimizer.init, p)) for p in cut.split(params)]
    except (ValueError, TypeError) as e:
        raise OptimizerError(
            "optimizer: it cannot run stage by stage on a part of the parameters (a mask "
            "or label tree for the whole model? give optax.masked / multi_transform a "
            f"function of the parameters instead): {str(e).splitlines()[0]}"
        ) from e
    got = [jax.tree.structure(s) for s in split_opt_state(cut, whole, params)]
    if got != want:
        raise OptimizerError(
            "optimizer: its state cannot be split by pipeline stage (its per-parameter "
            "parts are not trees shaped like the parameters); use a plain optax chain"
        )
