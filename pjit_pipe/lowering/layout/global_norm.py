"""optax's tree norms over the whole model while each device updates only its stages.

Each device runs the optax update of the stages it holds, inside a
`lax.switch` on its pipeline position. A transform that reads a norm of the
whole update tree (`optax.clip_by_global_norm`, anything calling
`optax.tree.norm`, which `optax.global_norm` also calls) would see only its
stage's part. The lowering runs the update in passes instead: while tracing
an update, `optax.tree.norm` is answered by a `StageNorms`, which gives the
k-th call the global value found by the earlier passes, and records the local
reduction of the first call not known yet (sum of squares, sum of absolute
values, or max). The lowering combines those outside the switch (every
device takes part in the collective; docs/design.md section 5) and traces again
with one more call known, until every call is global.

The hook is installed on `optax.tree.norm` once and answers through a
ContextVar, so outside a StageNorms (and in other threads) it is optax's own
function.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optax.tree

from pjit_pipe.errors import OptimizerError

SUM, MAX = "sum", "max"  # how the local reductions of a call combine across stages

_ACTIVE: ContextVar[StageNorms | None] = ContextVar("pjit_pipe_stage_norms", default=None)
_install_lock = threading.Lock()
_optax_norm: Callable[..., jax.Array] | None = None


def _hooked_norm(tree: Any, ord: Any = None, squared: bool = False) -> jax.Array:
    active = _ACTIVE.get()
    if active is None:
        return _optax_norm(tree, ord=ord, squared=squared)
    return active(tree, ord, squared)


def _install() -> None:
    global _optax_norm
    with _install_lock:
        if _optax_norm is None:
            _optax_norm = optax.tree.norm
            optax.tree.norm = _hooked_norm


class StageNorms:
    """Answers optax.tree.norm calls of one stage's update (see the module docstring).

    known: the global reductions of the first calls (combined over stages).
    record: the index of the call whose local reduction this pass records.
    """

    def __init__(
        self,
        known: list[jax.Array],
        record: int | None,
        uncounted: frozenset[str] = frozenset(),
        mask: Callable[[Any], Any] | None = None,
    ):
        self.known = known
        self.record = record
        # Units (top-level keys of the stage's tree) this stage holds a copy of
        # but another stage counts: a tied weight enters the whole model's norm once.
        self.uncounted = uncounted
        # Zeroes what another device counts in a tree of ZeRO slices (zero_norms.py).
        self.mask = mask
        self.calls = 0
        self.recorded: jax.Array | None = None
        self.combine: str | None = None  # SUM or MAX, for the recorded call

    def __call__(self, tree: Any, ord: Any, squared: bool) -> jax.Array:
        if self.uncounted and isinstance(tree, dict) and self.uncounted <= tree.keys():
            tree = {k: v for k, v in tree.items() if k not in self.uncounted}
        if self.mask is not None:
            tree = self.mask(tree)
        leaves = [jnp.asarray(a) for a in jax.tree.leaves(tree)]
        dtype = jnp.result_type(*leaves) if leaves else jnp.float32
        f32 = [a.astype(jnp.float32) for a in leaves]
        if ord is None or ord == 2:
            combine, local = SUM, sum((jnp.sum(jnp.square(a)) for a in f32), jnp.float32(0))
        elif ord == 1:
            combine, local = SUM, sum((jnp.sum(jnp.abs(a)) for a in f32), jnp.float32(0))
        elif ord == jnp.inf or ord in ("inf", "infinity"):
            combine, local = MAX, jnp.max(jnp.stack([jnp.max(jnp.abs(a)) for a in f32] or [0.0]))
        else:
            raise OptimizerError(f"optax.tree.norm: unsupported ord {ord!r}")
        k, self.calls = self.calls, self.calls + 1
        if k == self.record:
            self.recorded, self.combine = local, combine
        total = self.known[k] if k < len(self.known) else local
        if ord is None or ord == 2:
            out = total if squared else jnp.sqrt(total)
        else:
            out = jnp.square(total) if squared else total
        return out.astype(dtype)


@contextlib.contextmanager
def stage_norms(norms: StageNorms) -> Iterator[StageNorms]:
    """Within this block (in this thread), optax.tree.norm calls go to `norms`."""
    _install()
    token = _ACTIVE.set(norms)
    try:
        yield norms
    finally:
        _ACTIVE.reset(token)


def count_norm_calls(optimizer: optax.GradientTransformation, params: Any, opt_state: Any) -> int:
    """How many optax.tree.norm calls one update makes (shapes only, nothing runs)."""
    norms = StageNorms([], None)

    def update(p, o):
        with stage_norms(norms):
            return optimizer.update(p, o, p)

    jax.eval_shape(update, params, opt_state)
    return norms.calls
