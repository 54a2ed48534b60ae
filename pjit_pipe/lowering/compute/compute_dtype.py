"""The dtype each parameter leaf is computed in: the narrower float a model casts it to.

A Flax module with `dtype=jnp.bfloat16` keeps its parameters float32 and casts
each one to bfloat16 where it reads it (`promote_dtype`). The stage then
computes on the bf16 copy, and the float32 gradient is that copy's bf16
cotangent converted back (the transpose of a cast is a cast). So a leaf whose
one use is such a cast can be handed to the stage already cast: the forward
sees the same bf16 values, and the parameter gradient comes out in bf16 with
the same values, to be summed over microbatches in float32 by the caller.
ZeRO-3 then all-gathers such leaves in bf16 (layout/zero.py), half the bytes,
and each op's gradient is half the bytes until it is added to the float32
accumulator.

A leaf qualifies only where that is exact: exactly one use in the stage, that
use a cast to a narrower float, reached through calls that pass it as it is
(jit, checkpoint, a cond's operands, a scan's per-iteration slices). Two uses
would have their cotangents summed in bf16 (a tied embedding), a scan's
loop-invariant operand its iterations' cotangents, and a custom rule may
differentiate the leaf otherwise: those leaves stay float32.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from pjit_pipe.lowering.layout.flat_buffers import FlatSpec, dtype_of, is_shaped
from pjit_pipe.lowering.layout.param_layout import device_param_spec

# Calls whose body reads its operands one to one (a sub-jaxpr per call).
_CALLS = {"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2"}


def compute_dtypes(fn: Callable, params: Any, *args: Any) -> list[np.dtype | None]:
    """Per leaf of `params` (in `jax.tree.leaves` order), the dtype `fn(params,
    *args)` computes it in where that is a narrower float it casts the leaf to
    in its one use (module docstring), else None (the leaf is used as it is)."""
    closed = jax.make_jaxpr(fn)(params, *args)
    n = len(jax.tree.leaves(params))
    return [_cast_of(closed.jaxpr, v) for v in closed.jaxpr.invars[:n]]


def _body(value: Any) -> Jaxpr:
    return value.jaxpr if isinstance(value, ClosedJaxpr) else value


def _cast_of(jaxpr: Jaxpr, var: Any) -> np.dtype | None:
    """The dtype `var`'s one use in `jaxpr` casts it to, if it qualifies."""
    if any(out is var for out in jaxpr.outvars):
        return None
    uses = [(eqn, i) for eqn in jaxpr.eqns for i, x in enumerate(eqn.invars) if x is var]
    if len(uses) != 1:
        return None
    eqn, i = uses[0]
    name, params = eqn.primitive.name, eqn.params
    if name == "convert_element_type":
        new, old = np.dtype(params["new_dtype"]), np.dtype(var.aval.dtype)
        narrower = new.itemsize < old.itemsize
        floats = jnp.issubdtype(new, jnp.floating) and jnp.issubdtype(old, jnp.floating)
        return new if narrower and floats else None
    if name in _CALLS:
        body = _body(params.get("jaxpr", params.get("call_jaxpr")))
        return None if body is None else _cast_of(body, body.invars[i])
    if name == "cond" and i > 0:
        got = {_cast_of(_body(b), _body(b).invars[i - 1]) for b in params["branches"]}
        return got.pop() if len(got) == 1 else None
    if name == "scan" and _is_sliced(eqn, i):
        body = _body(params["jaxpr"])
        return _cast_of(body, body.invars[i])
    return None


def _is_sliced(eqn: Any, i: int) -> bool:
    """Whether operand i of a scan is one of its `xs` (sliced per iteration), not a
    constant or a carry. The xs come last, and each is the body's operand with the
    leading length axis (constants and carries have the body's shape)."""
    body = _body(eqn.params["jaxpr"])
    length = eqn.params["length"]
    outer, inner = eqn.invars[i].aval.shape, body.invars[i].aval.shape
    return outer == (length, *inner) and all(
        v.aval.shape == (length, *b.aval.shape)
        for v, b in zip(eqn.invars[i:], body.invars[i:], strict=True)
    )


def buffer_dtypes(spec: FlatSpec, dtypes: Sequence[Sequence[np.dtype | None]]) -> dict[str, str]:
    """Per buffer of a parameter layout (`spec`: tree s is stage s), the dtype every
    leaf it holds, in every stage, is computed in (`dtypes[s]`: `compute_dtypes` of
    stage s), where that is one narrower float; buffers holding any leaf used as it
    is are left out. ZeRO-3 all-gathers each buffer in this dtype (layout/zero.py)."""
    found: dict[str, set[Any]] = {}
    for slots, leaf_dtypes in zip(spec.slots, dtypes, strict=True):
        for (key, _, _), d in zip(slots, leaf_dtypes, strict=True):
            found.setdefault(key, set()).add(None if d is None else np.dtype(d).name)
    return {k: got.pop() for k, got in found.items() if len(got) == 1 and None not in got}


def compute_param_spec(
    avals: Sequence[Any],
    splits: Sequence[Any] | None,
    multiple: int,
    dtypes: Sequence[Sequence[np.dtype | None]],
) -> FlatSpec:
    """The device layout of the parameters (`device_param_spec`), with the leaves a
    stage uses in their own dtype kept out of flat rows that hold leaves it casts
    (`dtypes[s]`: `compute_dtypes` of stage s): each such leaf gets a size class,
    so the flat rows hold cast leaves only and ZeRO-3 can gather them in the compute
    dtype (`buffer_dtypes`). A bf16 Llama's RMSNorm scales, read in float32, would
    otherwise keep its whole row float32."""
    spec = device_param_spec(avals, splits, multiple)
    own: collections.Counter[tuple[str, int]] = collections.Counter()
    cast = False
    for slots, leaf_dtypes in zip(spec.slots, dtypes, strict=True):
        counts: collections.Counter[tuple[str, int]] = collections.Counter()
        for (key, _, n), d in zip(slots, leaf_dtypes, strict=True):
            if is_shaped(key) or "#" in key:
                continue
            cast |= d is not None
            if d is None:
                counts[dtype_of(key), n] += 1
        own |= counts  # per size, the most of any stage
    if not (cast and own):
        return spec
    trees = [jax.tree.unflatten(t, a) for t, a in zip(spec.treedefs, spec.avals, strict=True)]
    return FlatSpec(trees, splits=splits, multiple=multiple, classes=dict(own))
