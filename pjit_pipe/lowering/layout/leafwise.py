"""Whether an optax update is one elementwise rule applied to every parameter.

A stage's optax update normally runs on its parameter tree, cut out of the
device's flat row leaf by leaf and packed back (optimizer.py): one set of
XLA kernels per leaf, each with its own slice offsets baked in. When the
update treats every element of every parameter leaf by the same rule (adam,
adamw, sgd, momentum, lion, schedules), it can run on the whole flat row
instead (row_optimizer.py) and give the same numbers, element for element.

`leafwise` decides that from the update's jaxpr, not from the optimizer's
name. It traces `update` + `apply_updates` on a stage's parameter tree and
on the flat row tree, inlines nested calls (flat_jaxpr.py), and walks back
from the outputs. It requires that
- every equation is elementwise (ELEMENTWISE, or a broadcast of a scalar),
  so nothing reduces, reshapes, gathers or draws random numbers;
- no value mixes two parameter leaves;
- each output leaf (new parameter, each parameter-shaped part of the new
  state) is the same expression of its own leaf's inputs and the shared
  scalars for every leaf of a dtype, and the same expression in the flat
  trace, where the leaf is the whole row.
A mask over the parameter tree (weight decay on matrices only), per-leaf
norms (LAMB, clipping per leaf), factored moments, noise with one key per
leaf and a norm of the whole tree all break one of these, and such
optimizers keep the per-leaf update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from pjit_pipe.lowering.compute.flat_jaxpr import Lit, flatten

# Primitives that compute each output element from the same element of their
# operands (scalars broadcast), with no parameter that depends on the shape.
ELEMENTWISE = frozenset(
    {
        "abs", "add", "add_any", "and", "atan2", "cbrt", "ceil", "clamp",
        "convert_element_type", "copy", "copy_p", "cos", "div", "eq", "erf", "erf_inv",
        "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le",
        "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter",
        "not", "or", "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n",
        "sign", "sin", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
    }
)  # fmt: skip


class _NotLeafwise(Exception):
    """The traced update is not one elementwise rule per leaf."""


def like(tree: Any) -> Callable[[Any], bool]:
    """Whether a node of an optax state has the structure of the parameter `tree`."""
    treedef = jax.tree.structure(tree)
    return lambda node: jax.tree.structure(node) == treedef


def _step(optimizer: optax.GradientTransformation) -> Callable:
    def step(grads, state, params):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _roles(state: Any, params: Any) -> list[tuple[Any, int | None]]:
    """Per leaf of `state`: (role, parameter leaf index or None). A parameter-shaped
    node t gives its leaves role ('node', t); any other leaf is ('scalar', t)."""
    is_param = like(params)
    out = []
    for t, node in enumerate(jax.tree.leaves(state, is_leaf=is_param)):
        if is_param(node):
            out += [(("node", t), i) for i in range(len(jax.tree.leaves(node)))]
        else:
            out.append((("scalar", t, np.shape(node), str(node.dtype)), None))
    return out


def _signatures(
    optimizer: optax.GradientTransformation, params: Any, names: dict[Any, int]
) -> dict[Any, int]:
    """{(output role, dtype): expression id} of one trace; `names` interns the
    expressions, shared between traces so their ids compare."""
    state = jax.eval_shape(optimizer.init, params)
    closed, (_, out_state) = jax.make_jaxpr(_step(optimizer), return_shape=True)(
        params, state, params
    )
    n = len(jax.tree.leaves(params))
    labels = (
        [(("grad",), i) for i in range(n)]
        + _roles(state, params)
        + [(("param",), i) for i in range(n)]
    )
    out_labels = [(("param",), i) for i in range(n)] + _roles(out_state, params)
    eqns, inputs, outputs, avals = flatten(closed)
    shapes = [np.shape(a) for a in jax.tree.leaves(params)]

    def intern(key: Any) -> int:
        return names.setdefault(key, len(names))

    expr: dict[int, int] = {}  # value id -> expression id
    leaf: dict[int, int | None] = {}  # value id -> the parameter leaf it derives from
    for v, (role, i) in zip(inputs, labels, strict=True):
        expr[v], leaf[v] = intern(("in", role, str(avals[v].dtype), avals[v].weak_type)), i
    made = {o: e for e in eqns for o in e.outs}
    needed: set[int] = set()
    stack = [o for o in outputs if not isinstance(o, Lit)]
    while stack:
        v = stack.pop()
        if v in needed or v in expr:
            continue
        needed.add(v)
        stack += [a for a in made[v].ins if not isinstance(a, Lit)]
    for e in eqns:
        if not needed.intersection(e.outs):
            continue
        name = e.eqn.primitive.name
        operands = []
        for a in e.ins:
            if isinstance(a, Lit):
                value = np.asarray(a.value)
                if value.size != 1:
                    raise _NotLeafwise(f"a constant of shape {value.shape}")
                operands.append(intern(("lit", str(value.dtype), value.item())))
            else:
                operands.append(expr[a])
        froms = {leaf[a] for a in e.ins if not isinstance(a, Lit)} - {None}
        if len(froms) > 1:
            raise _NotLeafwise(f"{name} mixes parameter leaves {sorted(froms)}")
        src = froms.pop() if froms else None
        if name == "broadcast_in_dim":
            if any(np.shape(avals[a]) != () for a in e.ins if not isinstance(a, Lit)):
                raise _NotLeafwise("a broadcast of a non-scalar")
            params_key: Any = ()
        elif name in ELEMENTWISE:
            params_key = tuple(sorted((k, repr(p)) for k, p in e.eqn.params.items()))
        else:
            raise _NotLeafwise(f"{name} is not elementwise")
        for j, o in enumerate(e.outs):
            if src is not None and np.shape(avals[o]) != shapes[src]:
                raise _NotLeafwise(f"{name} changes a leaf's shape")
            dtype = (str(avals[o].dtype), avals[o].weak_type)
            expr[o], leaf[o] = intern((name, params_key, tuple(operands), j, dtype)), src
    sig: dict[Any, int] = {}
    for o, (role, i) in zip(outputs, out_labels, strict=True):
        if isinstance(o, Lit):
            value = np.asarray(o.value)
            e, src, dtype = intern(("lit", str(value.dtype), value.item())), None, value.dtype
        else:
            e, src, dtype = expr[o], leaf[o], avals[o].dtype
        if src is not None and src != i:
            raise _NotLeafwise(f"output leaf {i} derives from leaf {src}")
        key = (role, str(dtype))
        if sig.setdefault(key, e) != e:
            raise _NotLeafwise(f"the leaves of {role} follow different rules")
    return sig


def leafwise(
    optimizer: optax.GradientTransformation, stage_params: list[Any], row: Any
) -> str | None:
    """None when the update is one elementwise rule for every leaf of every stage
    and for the flat `row` tree (the module docstring), else why not.

    stage_params: each stage's parameter tree (avals); row: {key: (L,) aval}.
    """
    names: dict[Any, int] = {}
    try:
        flat = _signatures(optimizer, row, names)
        for params in stage_params:
            for key, e in _signatures(optimizer, params, names).items():
                if flat.get(key, e) != e:
                    raise _NotLeafwise(f"{key[0]} differs between a leaf and a whole row")
    except _NotLeafwise as why:
        return str(why)
    return None
