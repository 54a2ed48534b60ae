"""The compiled asynchronous 1F1B program: weight modes predict, stash and latest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pjit_pipe.lowering import lower
from pjit_pipe.lowering.async_weights import staleness
from pjit_pipe.schedules import make_schedule
from pjit_pipe.schedules.asynchronous import async_one_f_one_b
from tests.test_lowering import (
    MB,
    assert_trees_close,
    batch,
    mesh_of,
    reference_loss,
    tiny_model,
    xent,
)

P, M, ITERS = 2, 2, 2


def per_microbatch_training(fns, params, opt, batches):
    """Unpipelined: one optax step per microbatch, in order; (params, loss per iteration)."""
    state, losses = opt.init(params), []
    grad_fn = jax.jit(jax.value_and_grad(reference_loss, argnums=1), static_argnums=0)
    for x, y in batches:
        mb_losses = []
        for j in range(M):
            part = slice(j * MB, (j + 1) * MB)
            loss, g = grad_fn(tuple(fns), params, x[part], y[part])
            upd, state = opt.update(g, state, params)
            params = optax.apply_updates(params, upd)
            mb_losses.append(float(loss))
        losses.append(np.mean(mb_losses))
    return params, losses


@pytest.fixture(scope="module")
def problem():
    fns, params = tiny_model(P)
    batches = [batch(M * MB, seed=40 + i) for i in range(ITERS)]
    opt = optax.sgd(0.3, momentum=0.9)
    return fns, params, batches, opt, per_microbatch_training(fns, params, opt, batches)


def test_staleness_is_read_from_the_schedule():
    s = make_schedule("async-1f1b", 4, 4)
    assert [staleness(s, p) for p in range(4)] == [3, 2, 1, 0]
    flat = async_one_f_one_b(4, 4, stale=False)
    assert [staleness(flat, p) for p in range(4)] == [0, 0, 0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["predict", "stash", "latest"])
def test_zero_staleness_is_per_microbatch_sgd(problem, mode):
    fns, params, batches, opt, (ref_params, ref_losses) = problem
    sched = async_one_f_one_b(P, M, stale=False)
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    step = lower(
        sched,
        fns,
        xent,
        mesh_of(1, P),
        params,
        *batches[0],
        optimizer=opt,
        iterations=ITERS,
        async_weights=mode,
    )
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    np.testing.assert_allclose(np.asarray(losses), ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params)
