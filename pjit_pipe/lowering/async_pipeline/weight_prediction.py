"""PipeOptim's weight prediction: the weights a stage will hold s optimizer steps from now.

In asynchronous 1F1B, s = P - p - 1 updates land on position p between a
microbatch's forward and its backward. PipeOptim (Guan et al., arXiv
2312.00839) runs the forward on predicted weights

    W_hat = W_t - lr * s * dW_t

where dW_t is the optimizer's own update direction at step t:

- SGD with momentum mu: dW_t = mu * v_{t-1} + g_t (optax's trace has no
  dampening; plain SGD: dW_t = g_t);
- Adam and AdamW: dW_t = m_hat_t / (sqrt(v_hat_t) + eps), bias-corrected;
- RMSprop: dW_t = g_t / (sqrt(nu_t) + eps).

For each of these, the update optax applied at step t is exactly -lr * dW_t, so
the prediction is W_t + s * u_t with u_t the last applied update: one extra
parameter-sized buffer per stage, and no need to know the optimizer's
hyperparameters. (For AdamW, u_t also holds the decoupled weight decay
-lr * wd * W_{t-1}; the paper leaves it out of dW_t, which changes W_hat by
s * lr * wd * W, a relative 1e-7 at typical settings.) Which optimizer it is
comes from the optax chain's state: only the ones above are supported, because
for others (lion, adagrad, adafactor, ...) the last update is not the
direction the paper's formula extrapolates.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from pjit_pipe.errors import OptimizerError

SUPPORTED = ("sgd", "sgd with momentum", "adam", "adamw", "rmsprop")

# State types that do not change the update direction (scales, clipping, schedules).
_NEUTRAL = frozenset({"EmptyState", "ScaleByScheduleState", "ClipState"})
# The state of each supported direction, and the name given in errors and reports.
_DIRECTION = {
    "TraceState": "sgd with momentum",
    "ScaleByAdamState": "adam/adamw",
    "ScaleByRmsState": "rmsprop",
}


def _state_types(state: Any) -> list[str]:
    """Names of the optax state types in `state`, looking through chains and wrappers."""
    if isinstance(state, optax.MaskedNode) or state is None:
        return []
    inner = getattr(state, "inner_state", None)
    if inner is not None:  # inject_hyperparams, masked, MultiSteps-like wrappers
        return _state_types(inner)
    if isinstance(state, tuple) and not hasattr(state, "_fields"):  # a chain
        return [name for s in state for name in _state_types(s)]
    if isinstance(state, dict | list):
        return [name for s in jax.tree.leaves(state, is_leaf=_is_state) for name in _state_types(s)]
    return [type(state).__name__]


def _is_state(node: Any) -> bool:
    return hasattr(node, "_fields")


def recognise(opt_state: Any) -> str:
    """Which supported optimizer produced `opt_state` (an optax state); OptimizerError otherwise."""
    names = _state_types(opt_state)
    directions = [n for n in names if n in _DIRECTION]
    unknown = sorted({n for n in names if n not in _DIRECTION and n not in _NEUTRAL})
    if not unknown and len(directions) <= 1:
        return _DIRECTION[directions[0]] if directions else "sgd"
    found = ", ".join(unknown or directions)
    raise OptimizerError(
        f"optimizer: async_weights='predict' supports {', '.join(SUPPORTED)} (optax chains "
        f"of them, with clipping or schedules); this optimizer's state holds {found}. Use "
        "one of those, or async_weights='stash' or 'latest', which work with any optimizer"
    )


def last_update(old_params: Any, new_params: Any) -> Any:
    """u_t = W_t - W_{t-1}: what the optimizer applied at step t, i.e. -lr * dW_t."""
    return jax.tree.map(lambda new, old: new - old, new_params, old_params)


def predict(params: Any, update: Any, staleness: int | jax.Array) -> Any:
    """W_hat = W_t - lr * s * dW_t = W_t + s * u_t, with u_t from `last_update`."""
    return jax.tree.map(lambda w, u: w + staleness * u.astype(w.dtype), params, update)


__all__ = ["SUPPORTED", "last_update", "predict", "recognise"]
