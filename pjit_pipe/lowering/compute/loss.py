"""What a loss function returns, as one float32 vector that the pipeline accumulates.

`loss_fn(outputs, y_mb)` returns either the mean loss of a microbatch (a
scalar) or a pair `(loss_sum, weight)` (masked and weighted losses); with
`has_aux=True` it returns `(loss, aux)`, `loss` in either form and `aux` a
pytree of arrays (metrics). The last stage's F turns that into the vector
`[value, weight, *aux leaves]` (weight 1 for a mean loss).

Summed over the global batch's D*m microbatches, the pipelined loss is
`sum(value) / D*m` for a mean loss and `sum(loss_sum) / sum(weight)` for a
pair, and aux is the mean over microbatches. Only `value` is differentiated:
every backward is seeded with `scale = 1 / (D*m)`; for a pair the gradients
are then multiplied by `D*m / sum(weight)` once the total weight is known
(gradients are linear in the seed, so 1F1B need not know the weight early).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pjit_pipe.errors import LossFnError

VALUE, WEIGHT = 0, 1  # positions in the loss vector; aux leaves follow


def _floating_scalar(a: Any) -> bool:
    """A JAX or NumPy floating scalar (a Python float or None cannot carry a gradient)."""
    dtype = getattr(a, "dtype", None)
    return dtype is not None and np.shape(a) == () and jnp.issubdtype(dtype, jnp.floating)


def check_loss_fn(loss_fn: Any) -> None:
    """Raise LossFnError, before anything is traced, when `loss_fn` cannot be called
    as loss_fn(outputs, y)."""
    if not callable(loss_fn):
        raise LossFnError(
            f"loss_fn: expected a function loss_fn(outputs, y), got {type(loss_fn).__name__}"
        )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or C function: its call will tell
        return
    try:
        signature.bind(None, None)
    except TypeError as e:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        raise LossFnError(
            f"loss_fn: {name}{signature} cannot be called as loss_fn(outputs, y) ({e}); "
            "give it exactly the two arguments outputs and y (bind others with "
            "functools.partial)"
        ) from None


def _describe(got: Any) -> str:
    """What a loss function returned, in a few words (not a tracer's repr)."""
    if isinstance(got, tuple | list):
        return f"a {type(got).__name__} of ({', '.join(_describe(g) for g in got)})"
    if hasattr(got, "dtype"):
        return f"an array of shape {np.shape(got)} and dtype {got.dtype}"
    return f"{type(got).__name__} {got!r}"


class LossLayout:
    """The loss vector of one loss function for outputs and labels of these shapes."""

    def __init__(self, loss_fn: Callable, has_aux: bool = False):
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        # Read from what loss_fn returns the first time it is traced (`vector`).
        self.weighted = False
        self.aux_treedef: Any = None
        self.aux_avals: list[jax.ShapeDtypeStruct] = []
        self.size = 2

    def _read(self, got: Any) -> tuple[Any, Any]:
        """Check what loss_fn returned and record its form: (loss part, aux)."""
        if self.has_aux:
            if not (isinstance(got, tuple | list) and len(got) == 2):
                raise LossFnError(f"loss_fn with has_aux=True must return (loss, aux), got {got}")
            got, aux = got
        else:
            aux = ()
        weighted = isinstance(got, tuple | list)
        pair_ok = weighted and len(got) == 2 and all(map(_floating_scalar, got))
        if not (pair_ok or (not weighted and _floating_scalar(got))):
            raise LossFnError(
                "loss_fn must return a floating scalar array computed from the outputs (the "
                "microbatch mean loss) or a pair (loss_sum, weight) of them, got "
                f"{_describe(got)}; return e.g. jnp.mean((outputs - y) ** 2)"
            )
        leaves, self.aux_treedef = jax.tree.flatten(aux)
        self.weighted = weighted
        self.aux_avals = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in leaves]
        self.size = 2 + sum(int(np.prod(a.shape, dtype=np.int64)) for a in self.aux_avals)
        return got, aux

    def vector(self, out: Any, y: Any) -> jax.Array:
        """[value, weight, *aux]: float32 (size,); weight and aux carry no gradient."""
        got, aux = self._read(self.loss_fn(out, y))
        value, weight = got if self.weighted else (got, jnp.ones((), jnp.float32))
        rest = [jnp.ravel(a).astype(jnp.float32) for a in jax.tree.leaves(aux)]
        fixed = jnp.concatenate([weight.astype(jnp.float32)[None], *rest])
        return jnp.concatenate([value.astype(jnp.float32)[None], jax.lax.stop_gradient(fixed)])

    def accumulate_scale(self, scale: float) -> np.ndarray:
        """What one microbatch's vector is multiplied by before it is summed: `scale`
        for value and aux (they become means), 1 for the weight (a plain sum)."""
        mult = np.full((self.size,), scale, np.float32)
        mult[WEIGHT] = 1.0
        return mult

    def seed(self, scale: float) -> jax.Array:
        """The cotangent of one microbatch's vector: `scale` on value, 0 elsewhere."""
        return jnp.zeros((self.size,), jnp.float32).at[VALUE].set(scale)

    def grad_factor(self, total: jax.Array, count: int) -> jax.Array | None:
        """What the accumulated gradients are multiplied by, from the summed vector
        (or a stack of them, one per iteration): None for a mean loss. A total
        weight of 0 or less gives NaN: the loss is then not finite (a train step
        skips it), never an unnoticed inf or a sign-flipped update."""
        if not self.weighted:
            return None
        weight = total[..., WEIGHT]
        return jnp.where(weight > 0, count / jnp.where(weight > 0, weight, 1.0), jnp.nan)

    def loss(self, total: jax.Array, count: int) -> jax.Array:
        """The pipelined loss from the summed (accumulate_scale'd) vector(s)."""
        factor = self.grad_factor(total, count)
        return total[..., VALUE] if factor is None else total[..., VALUE] * factor

    def aux(self, total: jax.Array) -> Any:
        """The aux tree (means over microbatches, float32) from the summed vector."""
        out, start = [], 2
        for aval in self.aux_avals:
            n = int(np.prod(aval.shape, dtype=np.int64))
            out.append(total[start : start + n].reshape(aval.shape))
            start += n
        return jax.tree.unflatten(self.aux_treedef, out)
