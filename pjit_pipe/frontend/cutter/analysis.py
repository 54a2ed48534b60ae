"""What a traced function reads and what it costs, from its jaxpr.

The stage cutter traces candidate stages with every input it might secretly
depend on passed in as an argument; walking the jaxpr backwards from the
outputs tells which inputs really reach them (the rest is dead code that XLA
drops) and roughly how many FLOPs the live part takes.

Equations that wrap a sub-jaxpr (`jax.checkpoint` from nn.remat/nnx.remat,
`jit` from nn.jit, custom_jvp/vjp calls, `scan`, `cond`) are looked into, so
a remat'd block reads only what its body reads; any other equation with a
sub-jaxpr (while loops, unknown primitives) counts as reading all its inputs
(conservative: never misses a dependency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Primitives whose sub-jaxpr takes the equation's inputs and gives its outputs one to one.
_CALLS = {
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


@dataclass(frozen=True)
class Liveness:
    """used[i]: whether jaxpr input i reaches an output; flops of the live equations."""

    used: tuple[bool, ...]
    flops: float


def _open(j: ClosedJaxpr | Jaxpr) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def _own_flops(eqn) -> float:
    out_size = sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        return 2.0 * out_size * math.prod(lhs_shape[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        rhs_shape = eqn.invars[1].aval.shape
        out_features = rhs_shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * out_size * math.prod(rhs_shape) / max(out_features, 1)
    return float(out_size)


def _sub_jaxprs(eqn) -> list[Jaxpr]:
    subs = []
    for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
            if isinstance(sub, ClosedJaxpr | Jaxpr):
                subs.append(_open(sub))
    return subs


def _eqn(eqn, live_out: Sequence[bool]) -> tuple[list[bool], float]:
    """(which inputs of `eqn` reach its live outputs, FLOPs of the live part)."""
    name, n_in = eqn.primitive.name, len(eqn.invars)
    if name in _CALLS and _CALLS[name] in eqn.params:
        sub = _open(eqn.params[_CALLS[name]])
        if len(sub.invars) == n_in and len(sub.outvars) == len(live_out):
            inner = liveness(sub, live_out)
            return list(inner.used), inner.flops
    if name == "scan":
        return _scan(eqn, live_out)
    if name == "cond":
        used, flops = [True] + [False] * (n_in - 1), 0.0
        for branch in eqn.params["branches"]:
            inner = liveness(_open(branch), live_out)
            used[1:] = [a or b for a, b in zip(used[1:], inner.used, strict=True)]
            flops = max(flops, inner.flops)
        return used, flops
    subs = _sub_jaxprs(eqn)
    if subs:
        return [True] * n_in, sum(liveness(s).flops for s in subs) * eqn.params.get("length", 1)
    return [True] * n_in, _own_flops(eqn)


def _scan(eqn, live_out: Sequence[bool]) -> tuple[list[bool], float]:
    """A scan's inputs are (consts, carry, xs), its outputs (carry, ys): a carry is
    live if the final carry is, or if a live part of the body reads it."""
    body = _open(eqn.params["jaxpr"])
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    live_carry = list(live_out[:n_carry])
    while True:
        inner = liveness(body, [*live_carry, *live_out[n_carry:]])
        carry_in = inner.used[n_consts : n_consts + n_carry]
        grown = [a or b for a, b in zip(live_carry, carry_in, strict=True)]
        if grown == live_carry:
            break
        live_carry = grown
    used = list(inner.used)
    used[n_consts : n_consts + n_carry] = live_carry
    return used, inner.flops * eqn.params["length"]


def liveness(jaxpr: Jaxpr, live_out: Sequence[bool] | None = None) -> Liveness:
    """Backward reachability from the outputs (those flagged in `live_out`; all by default)."""
    flags = [True] * len(jaxpr.outvars) if live_out is None else list(live_out)
    live = {
        v for v, f in zip(jaxpr.outvars, flags, strict=True) if f and not isinstance(v, Literal)
    }
    flops = 0.0
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs):
            continue
        used, cost = _eqn(eqn, outs)
        flops += cost
        live.update(
            v for v, u in zip(eqn.invars, used, strict=True) if u and not isinstance(v, Literal)
        )
    return Liveness(tuple(v in live for v in jaxpr.invars), flops)
