"""Dropout and other random streams in a pipelined Flax model.

A step takes `rngs`: one key (the 'dropout' stream) or a dict {stream: key},
as linen's `apply(..., rngs=...)` does. The lowering gives each microbatch its
own keys (`fold_in(key, i)` for microbatch i of the global batch; see
`lowering/compute/rng.py`) and makes them current while it traces a stage; the
model view here passes the current keys to linen's `apply`. Every stage of a
microbatch gets the same keys and linen derives each submodule's stream from
its path, so a pipelined step draws exactly what `module.apply(params, x_i,
rngs={name: fold_in(key, i)})` draws for each microbatch x_i.
"""

from __future__ import annotations

import copy
from typing import Any

import jax

from pjit_pipe.frontend.cutter.adapters import LinenModel, Model
from pjit_pipe.lowering import current_rngs


def step_rngs(rngs: Any) -> dict[str, jax.Array] | None:
    """A step's rngs as {stream: key}: a single key is the 'dropout' stream."""
    if rngs is None or isinstance(rngs, dict):
        return rngs
    return {"dropout": rngs}


class _ApplyWithRngs:
    """Stands in for a linen module inside a `LinenModel`: `apply` passes the keys of
    the microbatch being traced (if any) as `rngs=`; everything else is the module's."""

    def __init__(self, module: Any):
        self._module = module

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        rngs = current_rngs()
        if rngs is not None:
            kwargs = {**kwargs, "rngs": rngs}
        return self._module.apply(variables, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def with_step_rngs(model: Model) -> Model:
    """The model view whose stages read the current microbatch keys (linen; an NNX
    module holds its rngs itself)."""
    if not isinstance(model, LinenModel) or isinstance(model.module, _ApplyWithRngs):
        return model
    model = copy.copy(model)
    model.module = _ApplyWithRngs(model.module)
    return model
