"""How a model's own annotations split its weights over the mesh's 'tensor' axis.

A Flax model says how a weight splits with `nn.with_partitioning(init,
(None, 'tensor'))` (mesh axis names), `nn.with_logical_partitioning(init,
('embed', 'mlp'))` with `nn.logical_axis_rules` mapping the logical names to
'tensor' or None, or NNX `sharding=` metadata. Such params come boxed
(`nn.Partitioned`); NNX keeps the names as variable metadata
(`NNXModel.sharding_names`). The pipeline works on the plain arrays and gives back
gradients and params boxed the same way (`rebox`), so the user keeps the tree
`module.init` returned. A weight without an annotation, or one whose
annotation names no 'tensor', is replicated over 'tensor'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from flax.linen import spmd

from pjit_pipe.errors import SplitError

TENSOR = "tensor"


@dataclass(frozen=True)
class Split:
    """One weight's split: per dimension 'tensor' or None (all None: replicated).
    A leaf of split trees, which `StageCut.split` hands on unchanged."""

    dims: tuple[str | None, ...] = ()

    @property
    def split(self) -> tuple[str | None, ...] | None:
        """The dims when some dimension is split, else None (replicated)."""
        return self.dims if TENSOR in self.dims else None


def is_split(node: Any) -> bool:
    return isinstance(node, Split)


def _is_box(node: Any) -> bool:
    return isinstance(node, meta.AxisMetadata)


def unbox(variables: Any) -> tuple[Any, Any]:
    """(the plain variables, the boxed tree to `rebox` with, or None if nothing is boxed)."""
    if not any(_is_box(a) for a in jax.tree.leaves(variables, is_leaf=_is_box)):
        return variables, None
    return meta.unbox(variables), variables


def rebox(plain: Any, boxed: Any) -> Any:
    """`plain` (params or gradients, the plain tree) in the boxes of `boxed`."""
    if boxed is None:
        return plain
    return jax.tree.map(
        lambda b, a: b.replace_boxed(a) if _is_box(b) else a, boxed, plain, is_leaf=_is_box
    )


def path_keys(path: Sequence[Any]) -> tuple[Any, ...]:
    """A pytree key path as its plain keys (dict keys, list indices)."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def splits_of(
    boxed: Any, plain: Any, tensor: int, names: Callable[[Any], Any] | None = None
) -> Any:
    """A tree like `plain` of `Split` leaves, checked against a tensor size `tensor`.

    `boxed` is the boxed tree from `unbox` (None: nothing split). `names`, for
    NNX, gives a leaf's path -> its sharding names (None: not annotated).
    """
    paths_plain = jax.tree_util.tree_flatten_with_path(plain)[0]
    boxes: list[Any] = [None] * len(paths_plain)
    if boxed is not None:
        boxes = jax.tree.leaves(boxed, is_leaf=_is_box)
    out = []
    for (path, leaf), box in zip(paths_plain, boxes, strict=True):
        name = jax.tree_util.keystr(path)
        dims: Sequence[Any] | None = None
        if isinstance(box, nn.LogicallyPartitioned):
            dims = _logical(name, box)
        elif isinstance(box, meta.Partitioned):
            dims = box.names
        elif names is not None:
            dims = names(path)
        out.append(_checked(name, np.shape(leaf), dims, tensor))
    return jax.tree.unflatten(jax.tree.structure(plain), out)


def _logical(name: str, box: nn.LogicallyPartitioned) -> tuple[Any, ...]:
    """The mesh axes of a logically named weight, under its own rules or the
    `nn.logical_axis_rules` in force."""
    rules = box.rules if box.rules is not None else spmd.get_logical_axis_rules()
    known = {logical for logical, _ in rules or ()}
    for d, logical in enumerate(box.names):
        if logical is not None and logical not in known:
            raise SplitError(
                f"weight {name}: dimension {d} has logical axis name {logical!r}, which the "
                f"logical axis rules {sorted(known)} do not map; add ({logical!r}, 'tensor') "
                f"or ({logical!r}, None) to nn.logical_axis_rules"
            )
    return tuple(nn.logical_to_mesh_axes(box.names, rules))


def _checked(name: str, shape: tuple[int, ...], dims: Any, tensor: int) -> Split:
    if dims is None:
        return Split()
    dims = tuple(dims)
    if len(dims) != len(shape):
        raise SplitError(
            f"weight {name}: its annotation {dims} names {len(dims)} dimensions but its "
            f"shape {shape} has {len(shape)}; give one name (or None) per dimension"
        )
    for d, axis in enumerate(dims):
        if axis not in (None, TENSOR):
            raise SplitError(
                f"weight {name}: dimension {d} is annotated with mesh axis {axis!r}; "
                "pjit_pipe splits weights over 'tensor' only (and data/stage itself): "
                "annotate it with 'tensor' or None"
            )
        if axis == TENSOR and shape[d] % tensor:
            raise SplitError(
                f"weight {name}: dimension {d} (size {shape[d]}) is split over 'tensor' but "
                f"the mesh's tensor size {tensor} does not divide it; use a tensor size "
                f"that divides {shape[d]}, or leave dimension {d} unsplit"
            )
    return Split(dims if tensor > 1 else tuple(None for _ in dims))


def stage_splits(
    cut: Any, params: Any, boxed: Any, tensor: int, names: dict | None
) -> list[list] | None:
    """Per stage of `cut` (a StageCut), per parameter leaf, its split over
    'tensor' or None (replicated), from linen boxes (`boxed`) or NNX metadata
    (`names`: path -> sharding names); None when nothing is annotated."""
    if boxed is None and names is None:
        return None
    lookup = None if names is None else lambda path: names.get(path_keys(path))
    stage_trees = cut.split(splits_of(boxed, params, tensor, lookup), is_split)
    return [[h.split for h in jax.tree.leaves(t, is_leaf=is_split)] for t in stage_trees]
