"""The unpipelined baseline the lowering benchmarks time pipelines against. No
environment set-up here (bench_lowering's forces the CPU backend; bench_gpu's
does not)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def scan_accumulation(apply: Callable[[Any, Any], Any], loss_fn: Callable, m: int):
    """f(params, x, y) -> (mean loss, mean gradients) over m microbatches:
    jax.value_and_grad of `loss_fn(apply(params, xb), yb)` for each microbatch,
    summed by a jitted lax.scan."""

    def loss(params, xb, yb):
        return loss_fn(apply(params, xb), yb)

    @jax.jit
    def step(params, x, y):
        xs = x.reshape(m, -1, *x.shape[1:])
        ys = y.reshape(m, -1, *y.shape[1:])
        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss)(params, *mb)), None

        (value, grads), _ = jax.lax.scan(body, zero, (xs, ys))
        return jax.tree.map(lambda a: a / m, (value, grads))

    return step
