"""A `lax.switch` that compiles equal branches once.

A tick's conditional has one branch per (op kind, virtual stage). The stages
cut from a stack of identical layers (the block stages of a GPT or a Llama)
trace to the same computation, but XLA compiles every branch of a conditional
on its own: P - 2 copies of the middle stages' F, B and W, each costing its
full compile time, in the step and in every failure variant. `merged_switch`
traces each branch once on the switch's operands and lets branches with equal
jaxprs share one, so compile time grows with the number of distinct stages,
not with P. `MergedBranches` does the merging, for a switch or for a chain of
two-way conds (tick.py's lanes that write a store in place on jax 0.10).

Equal means: the same printed jaxpr once dead equations are dropped (the
printer names variables canonically, so the text is the structure), and the
same constants, nested ones included (arrays by value, tracers by identity),
which the text does not show. A parameter that prints as an object's address
(a host callback, say) makes two branches differ, so the check errs towards
keeping branches apart, never towards merging different ones.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

# jax keeps dead-code elimination of jaxprs internal; it has this name and
# signature in jax 0.10, 0.11 and 0.12. Without it, branches that differ only by dead
# equations stay apart (correct, compiled twice).
try:
    from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:  # pragma: no cover - a jax that moved it
    _dce_jaxpr = None


class MergedBranches:
    """Functions of the same operands, traced once on them, equal ones merged.

    `count` distinct computations; `run(k, *operands)` runs the k-th;
    `index(i)` is the distinct computation of function i (a traced i too).
    """

    def __init__(self, branches: Sequence[Callable], *operands: Any):
        traced = [jax.make_jaxpr(fn, return_shape=True)(*operands) for fn in branches]
        self.out_tree = jax.tree.structure(traced[0][1])
        first_of: dict[tuple, int] = {}
        self.distinct: list[jex.ClosedJaxpr] = []
        self.of = np.zeros(len(branches), np.int32)  # function -> its distinct computation
        for i, (closed, _) in enumerate(traced):
            closed = _live(closed)
            key = _key(closed)
            if key not in first_of:
                first_of[key] = len(self.distinct)
                self.distinct.append(closed)
            self.of[i] = first_of[key]

    @property
    def count(self) -> int:
        return len(self.distinct)

    def run(self, k: int, *operands: Any) -> Any:
        """The k-th distinct computation on `operands` (the traced functions' operands)."""
        flat = jex.jaxpr_as_fun(self.distinct[k])(*jax.tree.leaves(operands))
        return jax.tree.unflatten(self.out_tree, flat)

    def index(self, i: Any) -> jax.Array:
        """Which distinct computation function i is (i clamped to the functions)."""
        return jnp.asarray(self.of)[jnp.clip(i, 0, len(self.of) - 1)]


def merged_switch(index: jax.Array, branches: Sequence[Callable], *operands: Any) -> Any:
    """`lax.switch(index, branches, *operands)`, with equal branches compiled once.

    Args:
        index: Which branch runs (clamped to the branches, as `lax.switch` does).
        branches: Functions of `operands` with equal output types.
        *operands: Their operands (pytrees).

    Returns:
        The output of branch `index`.
    """
    merged = MergedBranches(branches, *operands)
    if merged.count == 1:
        return merged.run(0, *operands)
    fns = [functools.partial(merged.run, k) for k in range(merged.count)]
    return lax.switch(merged.index(index), fns, *operands)


def _live(closed: jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    """`closed` without the equations no output depends on (inputs all kept)."""
    if _dce_jaxpr is None:
        return closed
    jaxpr, _ = _dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return jex.ClosedJaxpr(jaxpr, closed.consts)


def _key(closed: jex.ClosedJaxpr) -> tuple:
    """What makes two closed jaxprs compute the same thing (module docstring)."""
    return (str(closed.jaxpr), tuple(_fingerprint(c) for c in _constants(closed)))


def _constants(closed: jex.ClosedJaxpr) -> Iterator[Any]:
    """The constants of `closed` and of every jaxpr nested in its equations' params,
    and its non-scalar literals, in a fixed order."""
    yield from closed.consts
    yield from _nested_constants(closed.jaxpr)


def _nested_constants(jaxpr: jex.Jaxpr) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jex.Literal) and np.ndim(v.val) > 0:
                yield v.val
        for param in eqn.params.values():
            yield from _param_constants(param)


def _param_constants(param: Any) -> Iterator[Any]:
    if isinstance(param, jex.ClosedJaxpr):
        yield from _constants(param)
    elif isinstance(param, jex.Jaxpr):
        yield from _nested_constants(param)
    elif isinstance(param, (tuple, list)):
        for p in param:
            yield from _param_constants(p)


def _fingerprint(value: Any) -> tuple:
    """A constant's identity: a tracer's object, an array's dtype, shape and bytes."""
    if isinstance(value, jax.core.Tracer):
        return ("tracer", id(value))
    if jnp.issubdtype(getattr(value, "dtype", None), jax.dtypes.prng_key):
        value = jax.random.key_data(value)
    array = np.asarray(value)
    return (str(array.dtype), array.shape, hashlib.sha256(array.tobytes()).hexdigest())
