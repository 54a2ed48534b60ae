"""Random keys per microbatch, for stage functions that draw random numbers (dropout).

A step gets `rngs`, a dict {stream name: key}. Microbatch i of the global batch
(rows i*mb .. (i+1)*mb, i = replica*m + j; with iterations=N, i counts on
through the N batches) uses `jax.random.fold_in(key, i)` for every stream,
whatever the mesh, schedule or failure pattern, so a pipelined step is
reproducible and equals an unpipelined one that applies the model to each
microbatch with those keys. Every stage of the microbatch sees the same keys:
Flax derives each submodule's stream from its path, so stages draw
independent numbers.

The keys reach a stage function through a ContextVar while the lowering
traces it (stage functions keep their (params, act) signature). They travel
as raw key data, re-wrapped inside the stage function, so that stored vjp
residuals are plain integer arrays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.errors import RngError

Rngs = Mapping[str, jax.Array]

# (name -> raw key data of the microbatch being traced, name -> key impl)
_ACTIVE: ContextVar[tuple[dict, dict] | None] = ContextVar("pjit_pipe_rngs", default=None)


def as_typed(key: Any) -> jax.Array:
    """A typed key (jax.random.key), also from a legacy uint32 PRNGKey."""
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def check_rngs(rngs: Any) -> dict[str, jax.Array]:
    """{name: typed key} from a dict of keys; raises naming what is wrong."""
    if not isinstance(rngs, Mapping):
        raise RngError(f"rngs: expected a dict {{stream name: jax.random.key}}, got {rngs!r}")
    out = {}
    for name, key in rngs.items():
        try:
            typed = as_typed(jnp.asarray(key))
        except (TypeError, ValueError) as e:
            raise RngError(f"rngs[{name!r}]: expected a jax.random.key, got {key!r}") from e
        if typed.shape != ():
            raise RngError(f"rngs[{name!r}]: expected one key, got shape {typed.shape}")
        out[str(name)] = typed
    return out


def microbatch_key_data(rngs: Rngs, count: int, iterations: int = 1) -> dict[str, jax.Array]:
    """name -> raw key data of each microbatch: (count, ...) or (iterations, count, ...)."""
    index = jnp.arange(count * iterations, dtype=jnp.uint32)

    def per_microbatch(key):
        keys = jax.vmap(jax.random.fold_in, (None, 0))(key, index)
        data = jax.random.key_data(keys)
        return data if iterations == 1 else data.reshape(iterations, count, *data.shape[1:])

    return {name: per_microbatch(key) for name, key in rngs.items()}


@contextlib.contextmanager
def microbatch_rngs(key_data: dict[str, jax.Array], impls: dict[str, Any]) -> Iterator[None]:
    """Within this block, `current_rngs()` gives these keys (the lowering sets it
    around each op it traces)."""
    token = _ACTIVE.set((key_data, impls))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_key_data() -> tuple[dict[str, jax.Array], dict[str, Any]] | None:
    """(raw key data, key impls) of the microbatch being traced, or None outside:
    for code that passes the keys on as explicit inputs (split_backward.py)."""
    return _ACTIVE.get()


def current_rngs() -> dict[str, jax.Array] | None:
    """The keys of the microbatch being traced ({name: typed key}), or None outside."""
    active = _ACTIVE.get()
    if active is None:
        return None
    data, impls = active
    return {k: jax.random.wrap_key_data(d, impl=impls[k]) for k, d in data.items()}


def impls_of(rngs: Rngs) -> dict[str, Any]:
    return {name: jax.random.key_impl(key) for name, key in rngs.items()}
