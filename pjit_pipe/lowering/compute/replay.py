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

Not used, and the function is called directly, where the traced jaxpr could
depend on more than the arguments:
- with microbatch keys in scope (a model that draws random numbers reads
  them from a context variable, rng.py, so they would be baked in);
- with weights split over 'tensor' (a stage's sharding constraints name the
  mesh of the program that traced it).
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

from pjit_pipe.lowering.compute.rng import active_key_data

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
        if not self.enabled or active_key_data() is not None:
            return self.fn(*args)
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple(_signature(a) for a in leaves))
        with self._lock:
            entry = self._traced.get(key)
        if entry is None:
            entry = self._trace(tree, leaves)
            with self._lock:
                self._traced.setdefault(key, entry)
        closed, out_tree = entry
        return jax.tree.unflatten(out_tree, jex.jaxpr_as_fun(closed)(*leaves))

    def _trace(self, tree: Any, leaves: list[Any]) -> tuple[jex.ClosedJaxpr, Any]:
        structs = [
            jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
            for shape, dtype, weak in map(_signature, leaves)
        ]
        flat = lambda *xs: self.fn(*jax.tree.unflatten(tree, xs))  # noqa: E731
        with use_abstract_mesh(NO_MESH):  # not the mesh of the program tracing it now
            closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*structs)
        return closed, jax.tree.structure(out_shape)
