"""A stage computation traced once and replayed in every program that runs it.

A pipeline's step and each of its failure variants trace the same stage
computations (a stage's forward with its vjp residuals, its backward, its
weight gradient) on the same shapes: only the tick table around them differs.
Tracing one means running the Flax module and JAX's linearization and
transposition in Python: on the tiny GPT, a failure variant's trace takes
0.84 s without replay and 0.18 s with it. `jax.jit` would not share that
work: its cache is keyed on the mesh in context, and a variant runs on the
survivors' mesh.

So a `TracedOnce` traces its function to a jaxpr on the first call for each
argument signature (shapes, dtypes, weak types, tree structure), outside any
mesh, and every later call, in this program or another, evaluates that jaxpr
on its arguments: the same equations, bound afresh, with no Python model code
and no differentiation run again.

A model that draws random numbers reads its microbatch's keys from a
context variable (rng.py). Where keys are in scope, they become inputs of
the traced jaxpr like the arguments (the keys' stream names and
implementations are part of the signature), and the jaxpr's function puts
them back in scope for the model, so no key is baked in.

Not used, and the function is called directly, with weights split over
'tensor': a stage's sharding constraints name the mesh of the program that
traced it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, use_abstract_mesh

from pjit_pipe.lowering.compute.rng import active_key_data, microbatch_rngs

NO_MESH = AbstractMesh((), ())


def _signature(leaf: Any) -> tuple[tuple[int, ...], Any, bool]:
    return np.shape(leaf), jnp.result_type(leaf), bool(getattr(leaf, "weak_type", False))


class TracedOnce:
    """`fn(*args)` (arrays in, arrays out), its jaxpr traced once per argument
    signature and replayed (module docstring). `enabled=False` always calls `fn`."""

    def __init__(self, fn: Callable, enabled: bool = True):
        self.fn, self.enabled = fn, enabled
        self._traced: dict[Any, tuple[jex.ClosedJaxpr, Any]] = {}
        self._lock = threading.Lock()  # failure variants trace in background threads

    def __call__(self, *args: Any) -> Any:
        if not self.enabled:
            return self.fn(*args)
        keys, impls = active_key_data() or ({}, {})
        leaves, tree = jax.tree.flatten((args, keys))
        key = (tree, tuple(_signature(a) for a in leaves), tuple(sorted(impls.items())))
        with self._lock:
            entry = self._traced.get(key)
        if entry is None:
            entry = self._trace(tree, leaves, impls)
            with self._lock:
                self._traced.setdefault(key, entry)
        closed, out_tree = entry
        return jax.tree.unflatten(out_tree, jex.jaxpr_as_fun(closed)(*leaves))

    def _trace(
        self, tree: Any, leaves: list[Any], impls: dict[str, Any]
    ) -> tuple[jex.ClosedJaxpr, Any]:
        structs = [
            jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
            for shape, dtype, weak in map(_signature, leaves)
        ]

        def flat(*xs: Any) -> Any:
            args, keys = jax.tree.unflatten(tree, xs)
            if not keys:
                return self.fn(*args)
            with microbatch_rngs(keys, impls):  # the keys given, not those of this trace
                return self.fn(*args)

        with use_abstract_mesh(NO_MESH):  # not the mesh of the program tracing it now
            closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*structs)
        return closed, jax.tree.structure(out_shape)
