"""A jaxpr as one flat list of equations, with nested calls inlined.

The split backward (split_backward.py) classifies every value of a stage's
jaxpr as param-only, data or constant, and re-runs the equations one by one
(F's interpreter, W's param-only chain). Both are simplest on a flat list
where every value has one integer id and nested `jit`/`checkpoint` calls are
inlined, so that their own equations can be sites too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Call-like equations whose body is inlined (their body's own ops become sites).
INLINE = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "remat"}


@dataclass(frozen=True)
class Lit:
    """A literal or a closed-over constant of the jaxpr."""

    value: Any


@dataclass(frozen=True)
class Eqn:
    eqn: Any  # the jaxpr equation (primitive and params)
    ins: tuple[int | Lit, ...]  # operand value ids
    outs: tuple[int, ...]  # result value ids


def bind(eqn: Any, args: Sequence[Any]) -> list[Any]:
    """Apply one jaxpr equation to `args` (as `jax.core.eval_jaxpr` does).

    `get_bind_params` turns a call's body back into what `bind` takes (a call
    primitive's `subfuns` param); since jax 0.10 it returns one params dict.
    """
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def flatten(closed: ClosedJaxpr) -> tuple[list[Eqn], list[int], list[int | Lit], dict]:
    """(equations, input ids, output operands, id -> aval) with calls inlined."""
    eqns: list[Eqn] = []
    avals: dict[int, Any] = {}

    def fresh(aval) -> int:
        avals[len(avals)] = aval
        return len(avals) - 1

    def walk(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[int | Lit]) -> list:
        env: dict[Any, int | Lit] = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = Lit(c)
        for v, a in zip(jaxpr.invars, args, strict=True):
            env[v] = a

        def read(v):
            return Lit(v.val) if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if eqn.primitive.name in INLINE and body is not None:
                if isinstance(body, ClosedJaxpr):
                    outs = walk(body.jaxpr, body.consts, ins)
                else:
                    outs = walk(body, [], ins)
            else:
                outs = [fresh(v.aval) for v in eqn.outvars]
                eqns.append(Eqn(eqn, tuple(ins), tuple(outs)))
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]

    inputs = [fresh(v.aval) for v in closed.jaxpr.invars]
    outputs = walk(closed.jaxpr, closed.consts, inputs)
    return eqns, inputs, outputs, avals


def count_primitives(jaxpr: Jaxpr, name: str) -> int:
    """How many equations named `name` a jaxpr holds, sub-jaxprs included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    total += count_primitives(sub.jaxpr, name)
                elif isinstance(sub, Jaxpr):
                    total += count_primitives(sub, name)
    return total
