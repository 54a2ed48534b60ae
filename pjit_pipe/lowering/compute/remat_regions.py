"""What a model's own checkpointed regions hold while their backward runs.

A stage that checkpoints parts of itself (`nn.remat` around each block, as
the bundled Llama does) stores only each region's inputs for its backward
(its stage policy is then "all", residual_policy.default_policy). The
backward recomputes one region at a time: the region's forward again, now
keeping every residual its vjp needs, then its cotangents. So besides the
stored inputs, the backward's working set is one region's residuals and
their cotangents, the largest region's when they differ: the memory report
counts it (memory_prediction.py), because at LLM sizes it is no rounding
error (one Llama-3-70B block at 4096 tokens keeps its attention's
64 x 4096 x 4096 score and probability matrices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex

from pjit_pipe.lowering.compute.residual_policy import REMAT_PRIMITIVES


def region_residual_bytes(fn: Callable, *args: Any) -> int:
    """Bytes of the vjp residuals of the largest checkpointed region of `fn(*args)`
    (a region inside a loop counted for one iteration), not counting the region's
    inputs (it stores those itself); 0 where `fn` checkpoints nothing."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return max((_residual_bytes(body) for body in _regions(jaxpr)), default=0)


def _subs(value: Any) -> list[Any]:
    """The jaxprs in one equation parameter (a jaxpr, a closed one, or a sequence)."""
    if isinstance(value, tuple | list):
        return [j for v in value for j in _subs(v)]
    if isinstance(value, jex.ClosedJaxpr):
        return [value.jaxpr]
    return [value] if isinstance(value, jex.Jaxpr) else []


def _regions(jaxpr: Any) -> list[Any]:
    """The bodies of every checkpoint equation in `jaxpr`, at any depth."""
    found = []
    for eqn in jaxpr.eqns:
        subs = [j for v in eqn.params.values() for j in _subs(v)]
        if eqn.primitive.name in REMAT_PRIMITIVES:
            found += subs[:1]
        for sub in subs:
            found += _regions(sub)
    return found


def _residual_bytes(body: Any) -> int:
    """Bytes of the residuals `jax.vjp` keeps of a region's body, inputs excluded."""

    def residuals(*args: Any) -> list[Any]:
        _, pull = jax.vjp(lambda *a: jex.jaxpr_as_fun(jex.ClosedJaxpr(body, []))(*a), *args)
        return [leaf for leaf in jax.tree.leaves(pull) if all(leaf is not a for a in args)]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
    return sum(a.size * a.dtype.itemsize for a in jax.eval_shape(residuals, *avals))
