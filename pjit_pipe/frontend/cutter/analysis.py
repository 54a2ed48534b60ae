"""What a traced function reads and what it costs, from its jaxpr.

The stage cutter traces candidate stages with every input they might secretly
depend on passed in as an argument. Which inputs really reach the outputs is
answered by JAX's own dead-code elimination (`dce_jaxpr`, with which `jit` drops
unused inputs), so the answer follows each JAX release's primitives and
their params without this module reading them: it looks into
`jax.checkpoint` (nn.remat/nnx.remat), `jit` (nn.jit), `scan` (nn.scan: a
carry is live if the final carry is, or if a live part of the body reads it)
and `cond`; an equation it has no rule for (custom_jvp/vjp calls, unknown
primitives; while loops before jax 0.12) counts as reading all its inputs
(conservative: never misses a dependency).

The FLOPs are counted on what is left, sub-jaxprs included: a `scan` body
`length` times, the costliest branch of a `cond`. The params read there
(`length`, `dot_general`'s and `conv_general_dilated`'s `dimension_numbers`)
have the same names and forms in jax 0.10 to 0.12. A jaxpr this module cannot read
raises `JaxprError`, naming the equation's primitive and the JAX version.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.interpreters.partial_eval import dce_jaxpr

from pjit_pipe.errors import JaxprError

# Primitives whose sub-jaxprs are alternatives (one runs), not parts that all run.
_ALTERNATIVES = {"cond"}

# What reading an equation of an unexpected form raises (a missing param, another
# param layout).
_READ_ERRORS = (KeyError, AttributeError, IndexError, TypeError)


@dataclass(frozen=True)
class Liveness:
    """used[i]: whether jaxpr input i reaches an output; flops of the live equations."""

    used: tuple[bool, ...]
    flops: float


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
    """The jaxprs among an equation's params (open or closed, alone or in a tuple)."""
    subs = []
    for param in eqn.params.values():
        for sub in param if isinstance(param, tuple | list) else (param,):
            if isinstance(sub, ClosedJaxpr):
                subs.append(sub.jaxpr)
            elif isinstance(sub, Jaxpr):
                subs.append(sub)
    return subs


def _flops(jaxpr: Jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        subs = _sub_jaxprs(eqn)
        if not subs:
            total += _own_flops(eqn)
        elif eqn.primitive.name in _ALTERNATIVES:
            total += max(_flops(s) for s in subs)
        else:
            total += sum(_flops(s) for s in subs) * eqn.params.get("length", 1)
    return total


def _primitive_at_fault(error: BaseException) -> str:
    """The primitive of the innermost equation being read when `error` was raised.

    Every frame that reads one equation, here and in JAX's dead-code rules, holds
    it in a local named `eqn`; the innermost such frame names the culprit.
    """
    name = "(none found)"
    for frame, _ in traceback.walk_tb(error.__traceback__):
        primitive = getattr(frame.f_locals.get("eqn"), "primitive", None)
        name = getattr(primitive, "name", name)
    return name


def liveness(jaxpr: Jaxpr) -> Liveness:
    """Which inputs of `jaxpr` reach its outputs, and the FLOPs of the equations that do.

    Args:
        jaxpr: An open jaxpr, e.g. `jax.make_jaxpr(f)(*args).jaxpr`.

    Returns:
        `Liveness`: one flag per input, and the FLOPs of the live part.

    Raises:
        JaxprError: An equation has a form this JAX version's reader does not expect.
    """
    try:
        live, used = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
        return Liveness(tuple(used), _flops(live))
    except _READ_ERRORS as e:
        raise _unreadable(e) from e


def _unreadable(e: Exception) -> JaxprError:
    """The error for a jaxpr this JAX version's reader (`dce_jaxpr`) could not read."""
    return JaxprError(
        f"jaxpr: cannot read equation '{_primitive_at_fault(e)}' on jax {jax.__version__} "
        f"({type(e).__name__}: {e}); pjit_pipe supports jax 0.10.2 to 0.12.x: install one "
        "of those, or report the primitive and version"
    )


def reads_of_each_output(jaxpr: Jaxpr) -> list[tuple[bool, ...]]:
    """Per output of `jaxpr`, which of its inputs reach that output.

    Args:
        jaxpr: An open jaxpr.

    Returns:
        One tuple of flags per output, one flag per input.

    Raises:
        JaxprError: An equation has a form this JAX version's reader does not expect.
    """
    n = len(jaxpr.outvars)
    try:
        return [tuple(dce_jaxpr(jaxpr, [k == j for k in range(n)])[1]) for j in range(n)]
    except _READ_ERRORS as e:
        raise _unreadable(e) from e
