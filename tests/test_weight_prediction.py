"""PipeOptim's weight prediction against closed forms of optax's adam and SGD-momentum steps."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.lowering.async_pipeline.weight_prediction import last_update, predict, recognise
from pjit_pipe.models import ResidualMLP, mse_loss

W0 = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array([0.25])}
GRADS = [
    {"w": jnp.array([0.1, -0.2, 0.3]), "b": jnp.array([1.0])},
    {"w": jnp.array([-0.4, 0.5, 0.05]), "b": jnp.array([-2.0])},
]


def _run(optimizer, steps):
    """Params and state after `steps` optax steps, and the params one step before."""
    params, state = W0, optimizer.init(W0)
    prev = params
    for g in GRADS[:steps]:
        updates, state = optimizer.update(g, state, params)
        prev, params = params, optax.apply_updates(params, updates)
    return prev, params, state


def test_sgd_momentum_prediction_is_closed_form():
    lr, mu = 0.1, 0.9
    prev, params, state = _run(optax.sgd(lr, momentum=mu), 2)
    assert recognise(state) == "sgd with momentum"
    for k in W0:
        g1, g2 = (np.asarray(g[k], np.float64) for g in GRADS)
        v1 = g1  # v_0 = 0
        w2 = np.asarray(W0[k], np.float64) - lr * v1 - lr * (mu * v1 + g2)
        dw = mu * v1 + g2  # dW_2 = mu * v_1 + g_2
        np.testing.assert_allclose(params[k], w2, rtol=1e-5)
        for s in (0, 3):
            got = predict(params, last_update(prev, params), s)[k]
            np.testing.assert_allclose(got, w2 - lr * s * dw, rtol=1e-5, atol=1e-6)


def test_adam_prediction_is_closed_form():
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    prev, params, state = _run(optax.adam(lr, b1=b1, b2=b2, eps=eps), 2)
    assert recognise(state) == "adam/adamw"
    for k in W0:
        g1, g2 = (np.asarray(g[k], np.float64) for g in GRADS)
        m1, v1 = (1 - b1) * g1, (1 - b2) * g1**2
        w1 = np.asarray(W0[k], np.float64) - lr * (m1 / (1 - b1)) / (np.sqrt(v1 / (1 - b2)) + eps)
        m2, v2 = b1 * m1 + (1 - b1) * g2, b2 * v1 + (1 - b2) * g2**2
        dw = (m2 / (1 - b1**2)) / (np.sqrt(v2 / (1 - b2**2)) + eps)
        w2 = w1 - lr * dw
        np.testing.assert_allclose(params[k], w2, rtol=1e-5)
        got = predict(params, last_update(prev, params), 2)[k]
        np.testing.assert_allclose(got, w2 - lr * 2 * dw, rtol=1e-5, atol=1e-6)


def test_recognises_supported_chains():
    p = {"w": jnp.ones(2)}
    cases = {
        "sgd": optax.sgd(0.1),
        "rmsprop": optax.rmsprop(1e-3),
        "adam/adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    }
    for name, opt in cases.items():
        assert recognise(opt.init(p)) == name
    sched = optax.sgd(optax.linear_schedule(0.1, 0.01, 10), momentum=0.9)
    assert recognise(sched.init(p)) == "sgd with momentum"
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    assert recognise(injected.init(p)) == "adam/adamw"


@pytest.mark.parametrize("opt", [optax.lion(1e-3), optax.adagrad(1e-2), optax.adafactor()])
def test_unsupported_optimizer_is_named(opt):
    with pytest.raises(ValueError, match="supports sgd, sgd with momentum, adam, adamw, rmsprop"):
        recognise(opt.init({"w": jnp.ones((2, 2))}))


def test_prediction_keeps_dtype():
    w = {"w": jnp.ones(2, jnp.bfloat16)}
    u = {"w": jnp.full(2, 0.5, jnp.float32)}
    out = predict(w, u, 2)["w"]
    assert out.dtype == jnp.bfloat16 and math.isclose(float(out[0]), 2.0)


def test_one_stage_async_steps_are_sequential_optax_steps():
    """On one stage every horizon is 0 (the forward reads W itself): an async-1f1b
    step is m optax steps, one per microbatch, each on that microbatch's mean loss."""
    model = ResidualMLP(d_model=8, hidden=8, n_layers=2, d_out=4)
    x = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
    y = np.sin(x[:, :4])
    params = model.init(jax.random.key(0), x)
    optimizer = optax.adamw(1e-2)
    pm = pp.pipeline(
        model,
        stages=1,
        microbatches=2,
        schedule="async-1f1b",
        mesh=pp.make_mesh(data=1, stage=1, devices=jax.devices()[:1]),
        optimizer=optimizer,
    )
    step = pm.train_step(mse_loss, donate=False)
    state, _ = step(step.init(params, (x, y)), (x, y))
    expected, opt_state = params, optimizer.init(params)
    for xb, yb in zip(np.split(x, 2), np.split(y, 2), strict=True):
        grads = jax.grad(lambda p, xb=xb, yb=yb: mse_loss(model.apply(p, xb), yb))(expected)
        updates, opt_state = optimizer.update(grads, opt_state, expected)
        expected = optax.apply_updates(expected, updates)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
