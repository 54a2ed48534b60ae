"""A shard_map that hands the compiler no zero-size operand.

jax 0.11's compiler (Shardy's canonicalizer of `sdy.manual_computation`, which
is what a shard_map lowers to) crashes the process with a segmentation fault
when a shard_map has a zero-size operand; jax 0.10 and 0.12 compile it
(benchmarks/repro_tied_xla_segfault.py reproduces it). Such an operand comes
either from an argument or from a constant of the body, which shard_map passes
in as an operand: a scatter over a whole axis (`a.at[:].set(b)`,
`a.at[:, 0:n].add(b)`, common in user models) holds a zero-size index constant.

So the body is traced to a jaxpr inside the shard_map, its zero-size constants
are made anew inside (`jnp.zeros`, which lowers to no operand; a zero-size
array holds no values, so nothing changes), and zero-size arguments are made
inside the same way instead of crossing the boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS


def _is_spec(x: Any) -> bool:
    return isinstance(x, PS)


def _without_empty_constants(body: Callable) -> Callable:
    """body, its zero-size constants made inside it instead of closed over."""

    def run(*args):
        closed, out_shape = jax.make_jaxpr(body, return_shape=True)(*args)
        consts = [jnp.zeros(c.shape, c.dtype) if np.size(c) == 0 else c for c in closed.consts]
        out = jex.jaxpr_as_fun(jex.ClosedJaxpr(closed.jaxpr, consts))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return run


def shard_map_without_empty_operands(
    body: Callable, *, mesh: Any, in_specs: Any, out_specs: Any, **kwargs: Any
) -> Callable:
    """`jax.shard_map(body, mesh=, in_specs=, out_specs=, **kwargs)`, the same
    function, whose lowered program has no zero-size operand (module docstring).

    Args:
        body: the per-device function.
        mesh: the device mesh.
        in_specs: the arguments' PartitionSpecs (a prefix of the argument tuple).
        out_specs: the results' PartitionSpecs.
        **kwargs: passed to jax.shard_map (check_vma, axis_names).

    Returns:
        A function of the same arguments and results as the shard_map.
    """

    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        spec_tree = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub), in_specs, args, is_leaf=_is_spec
        )
        specs = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
        empty = [np.size(a) == 0 for a in leaves]
        local = [
            (NamedSharding(mesh, s).shard_shape(np.shape(a)), a.dtype) if e else None
            for a, s, e in zip(leaves, specs, empty, strict=True)
        ]

        def inner(*kept):
            rest = iter(kept)
            full = [jnp.zeros(*lo) if lo is not None else next(rest) for lo in local]
            return _without_empty_constants(body)(*jax.tree.unflatten(treedef, full))

        f = jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=tuple(s for s, e in zip(specs, empty, strict=True) if not e),
            out_specs=out_specs,
            **kwargs,
        )
        return f(*(a for a, e in zip(leaves, empty, strict=True) if not e))

    return call
