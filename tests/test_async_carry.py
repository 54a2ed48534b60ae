"""Asynchronous 1F1B across compiled calls: the carrying program (lowering/async_carry.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pjit_pipe.lowering import lower
from pjit_pipe.schedules import make_schedule
from tests.test_lowering import MB, assert_trees_close, batch, mesh_of, tiny_model, xent

P, M, CALLS = 4, 4, 3


@pytest.fixture(scope="module")
def problem():
    fns, params = tiny_model(P)
    batches = [batch(M * MB, seed=70 + i) for i in range(CALLS)]
    return fns, params, batches, optax.adam(0.02)


def lowered(problem, mode, iterations):
    fns, params, batches, opt = problem
    sched = make_schedule("async-1f1b", P, M)
    return lower(
        sched,
        fns,
        xent,
        mesh_of(1, P),
        params,
        *batches[0],
        optimizer=opt,
        iterations=iterations,
        async_weights=mode,
    )


@pytest.mark.parametrize("mode", ["stash"])
def test_calls_and_drain_equal_one_call_of_n_iterations(problem, mode):
    _, params, batches, _ = problem
    ref = lowered(problem, mode, CALLS)
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    want, _, want_losses = ref.train_step(params, ref.init_opt_state(params), xs, ys)

    step = lowered(problem, mode, 1)
    dev_params, dev_opt = step.layout.from_stages(params, step.init_opt_state(params))
    in_flight, losses = None, []
    for x, y in batches:
        dev_params, dev_opt, in_flight, loss = step.carry_train_step(
            dev_params, dev_opt, in_flight, x, y
        )
        losses.append(float(loss))
    dev_params, dev_opt, in_flight, loss = step.carry_train_step(
        dev_params, dev_opt, in_flight, drain=True
    )
    losses.append(float(loss))
    assert in_flight is None and np.isnan(losses[0])
    np.testing.assert_allclose(losses[1:], np.asarray(want_losses), rtol=1e-5)
    got, _ = step.layout.to_stages(dev_params, dev_opt)
    assert_trees_close(got, want)
