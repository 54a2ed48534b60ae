"""One traced set of stages for every program of the same stages.

The failure variants of a pipeline compile the same stage functions, loss
and shapes over other devices and tick tables. Building a `StageVjp` traces
every stage's forward and vjp and runs the split backward's site analysis:
on the tiny GPT (2x4, zb-h1) about 0.6 s of a variant's 0.7 s of building
before JAX traces the program. Programs given the same stage function
objects, loss function, shapes, split stages, residual policies and random
key streams take the `StageVjp` and `LossLayout` the first of them built,
and with it the stage computations it traced (replay.py). Neither changes
once built: the LossLayout records the loss's form while the StageVjp
traces the last stage, and the same function on the same shapes has the
same form; the keys' values are inputs of every traced stage, not part of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax

from pjit_pipe.lowering.compute.loss import LossLayout
from pjit_pipe.lowering.compute.stages import StageVjp

MAX_ENTRIES = 8  # the pipelines whose stages stay traced (least recently used first out)

_built: OrderedDict[Any, tuple[LossLayout, StageVjp]] = OrderedDict()
_lock = threading.Lock()  # failure variants build in background threads


def _shapes(tree: Any) -> tuple[Any, tuple[Any, ...]]:
    return jax.tree.structure(tree), tuple(jax.tree.leaves(tree))


def traced_stages(
    stage_fns: Sequence[Callable],
    loss_fn: Callable,
    has_aux: bool,
    stage_params: Sequence[Any],
    x_mb: Any,
    y_mb: Any,
    split: Collection[int],
    policies: Sequence[str] | None,
    tensor_split: bool = False,
    rng_impls: Mapping[str, Any] | None = None,
) -> tuple[LossLayout, StageVjp]:
    """(the loss layout, the StageVjp) of these stages: the ones built before for
    the same arguments, or built now. `stage_params`, `x_mb`, `y_mb` are avals;
    `tensor_split` as in StageVjp; `rng_impls`: the key streams' implementations
    of a model that draws random numbers (the stages take the keys as inputs,
    replay.py, so their values do not matter)."""
    key: tuple | None = (
        tuple(stage_fns),
        loss_fn,
        has_aux,
        tuple(_shapes(p) for p in stage_params),
        _shapes(x_mb),
        _shapes(y_mb),
        frozenset(split),
        None if policies is None else tuple(policies),
        tensor_split,
        tuple(sorted((rng_impls or {}).items())),
    )
    try:
        hash(key)
    except TypeError:  # an unhashable loss or stage function: build afresh
        key = None
    if key is not None:
        with _lock:
            if key in _built:
                _built.move_to_end(key)
                return _built[key]
    loss = LossLayout(loss_fn, has_aux)
    stages = StageVjp(
        stage_fns, loss.vector, stage_params, x_mb, y_mb, split, policies, tensor_split
    )
    if key is not None:
        with _lock:
            _built[key] = (loss, stages)
            while len(_built) > MAX_ENTRIES:
                _built.popitem(last=False)
    return loss, stages
