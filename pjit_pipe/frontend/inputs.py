"""What a pipelined call is given: the global batch's leading dimension, and the
errors a model that draws random numbers raises without keys, made one line."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.errors
import jax
import numpy as np

from pjit_pipe.errors import BatchError, RngError


def leading_dim(name: str, tree: Any) -> int:
    """The leading (global batch) dimension every leaf of `tree` shares; BatchError
    naming `name` for anything else (lists, scalars, leaves that disagree)."""
    leaves = jax.tree.leaves(tree)
    if not all(hasattr(a, "shape") for a in leaves):
        kinds = sorted({type(a).__name__ for a in leaves if not hasattr(a, "shape")})
        raise BatchError(
            f"{name}: expected arrays (NumPy or JAX) with a leading batch dimension, got a "
            f"{type(tree).__name__} holding {', '.join(kinds)} values; convert it with "
            f"np.asarray({name})"
        )
    dims = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if len(dims) != 1 or None in dims:
        raise BatchError(
            f"{name}: every leaf needs the same leading (global batch) dimension, got {dims}"
        )
    return dims.pop()


@contextlib.contextmanager
def explained_rng_errors() -> Iterator[None]:
    """linen's InvalidRngError (a model that draws random numbers, run without keys)
    as an error that says which argument to pass."""
    try:
        yield
    except flax.errors.InvalidRngError as e:
        raise RngError(
            f"rngs: the model draws random numbers ({e}); pass rngs=jax.random.key(...) "
            "(the 'dropout' stream) or a dict {stream: key} to the step, or make the "
            "model deterministic"
        ) from e
