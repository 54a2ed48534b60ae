"""What a traced function reads and what it costs, from its jaxpr.

The stage cutter traces candidate stages with every input it might secretly
depend on passed in as an argument; walking the jaxpr backwards from the
outputs tells which inputs really reach them (the rest is dead code that XLA
drops) and roughly how many FLOPs the live part takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal


@dataclass(frozen=True)
class Liveness:
    """used[i]: whether jaxpr input i reaches an output; flops of the live equations."""

    used: tuple[bool, ...]
    flops: float


def _eqn_flops(eqn) -> float:
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
    inner = 0.0
    for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
            if isinstance(sub, ClosedJaxpr | Jaxpr):
                jaxpr = sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub
                inner += liveness(jaxpr).flops
    if inner:
        return inner * eqn.params.get("length", 1)
    return float(out_size)


def liveness(jaxpr: Jaxpr) -> Liveness:
    """Backward reachability from the outputs; equations with sub-jaxprs count as
    reading all their inputs (conservative: never misses a dependency)."""
    live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    flops = 0.0
    for eqn in reversed(jaxpr.eqns):
        if not any(v in live for v in eqn.outvars):
            continue
        flops += _eqn_flops(eqn)
        live.update(v for v in eqn.invars if not isinstance(v, Literal))
    return Liveness(tuple(v in live for v in jaxpr.invars), flops)
