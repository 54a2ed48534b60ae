"""Residual policies per stage (lowering/compute/residual_policy.py) and remat="auto"
(frontend/planning/residual_choice.py): every policy gives jax.value_and_grad's
gradients, and the choice is the fastest measured policy within the memory limit."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import pjit_pipe as pp
import pjit_pipe.frontend.planning.residual_choice as choice_module
from pjit_pipe.errors import OptionError
from pjit_pipe.frontend.mesh import pipeline_mesh
from pjit_pipe.frontend.planning.residual_choice import choose_stage_policies, row_elements
from pjit_pipe.lowering import POLICIES, LossLayout, LoweringOptions, StageVjp, lower
from pjit_pipe.schedules import make_schedule
from tests.test_lowering import assert_trees_close, mesh_of

T, D = 4, 8  # tokens and width of an activation row


def block(p, a):
    """A tiny attention-like stage: a named dense layer (no batch dims), a batched
    score product, an elementwise tail. Its policies store different things."""
    h = checkpoint_name(jnp.tanh(a @ p["w"] + p["b"]), "hidden")
    scores = jax.nn.softmax(jnp.einsum("btd,bsd->bts", h, a), axis=-1)
    return a + jnp.einsum("bts,bsd->btd", scores, h) * p["g"]


def params_of(key, stages):
    keys = jax.random.split(key, stages)
    return [
        {
            "w": jax.random.normal(k, (D, D)) / np.sqrt(D),
            "b": 0.1 * jnp.ones((D,)),
            "g": jnp.ones((D,)),
        }
        for k in keys
    ]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def data(m):
    x = jax.random.normal(jax.random.key(1), (2 * m, T, D))
    y = jax.random.normal(jax.random.key(2), (2 * m, T, D))
    return x, y


def reference(params, x, y):
    a = x
    for p in params:
        a = block(p, a)
    return mse(a, y)


def check_gradients(kind, policies, m=2):
    S = len(policies)
    params, (x, y) = params_of(jax.random.key(0), S), data(m)
    step = lower(
        make_schedule(kind, S, m),
        [block] * S,
        mse,
        mesh_of(1, S),
        params,
        x,
        y,
        LoweringOptions(policies=policies),
    )
    assert step._low.st.policies == tuple(policies)
    loss, grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)


def test_mixed_policies_give_value_and_grad():
    """Stage 0 runs one backward, stages 1 and 2 the split B and W (zb-h1)."""
    check_gradients("zb-h1", ("nothing", "names", "dots_no_batch"))


@pytest.mark.slow  # one pipeline per policy and kind
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_value_and_grad(kind, policy):
    check_gradients(kind, (policy,) * 2)


def stage_chain(S=3, m=2):
    params, (x, y) = params_of(jax.random.key(0), S), data(m)
    mb = lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype)  # noqa: E731
    return params, mb(x), mb(y)


def test_policies_store_what_they_save():
    """Per microbatch, recomputing everything stores less than the matmul outputs,
    which store less than every residual; names saves the one named value."""
    params, x_mb, y_mb = stage_chain()
    loss = LossLayout(mse).vector
    total, built = {}, {}
    for p in POLICIES:
        st = built[p] = StageVjp([block] * 3, loss, params, x_mb, y_mb, (2,), (p,) * 3)
        total[p] = [sum(row_elements(st, s).values()) for s in range(3)]
    for s in range(3):
        assert total["nothing"][s] < total["names"][s] < total["dots"][s] <= total["all"][s]
        assert total["dots_no_batch"][s] < total["dots"][s]  # the score products go
    assert built["names"].saved_names == {s: ("hidden",) for s in range(3)}


@pytest.fixture
def timed(monkeypatch):
    """Replace the timer: each op's time is `table[policy][op]`, nothing runs."""
    table: dict[str, dict[str, float]] = {}

    def fake(ops, repeats):
        return {k: table[k.split(" ")[0]][k.split(" ")[1]] for k in ops}

    monkeypatch.setattr(choice_module, "time_ops", fake)
    return table


def choose(split, key=None):
    params, x_mb, y_mb = stage_chain()
    mesh = pipeline_mesh(pp.make_mesh(1, 3))
    return choose_stage_policies([block] * 3, mse, params, x_mb, y_mb, mesh, split, key)


@pytest.mark.parametrize("seed", range(2))
def test_the_choice_is_the_fastest_measured_within_the_limit(timed, seed):
    rng = np.random.default_rng(seed)
    for p in POLICIES:
        timed[p] = {op: float(rng.uniform(1, 2)) for op in ("F", "B", "W", "BW")}
    choices = choose(split={1, 2})
    for s, c in enumerate(choices):
        ops = ("F", "B", "W") if s in (1, 2) else ("F", "BW")
        assert c.split == (s in (1, 2))
        want = {p: sum(timed[p][op] for op in ops) for p in POLICIES}
        assert c.seconds == pytest.approx(want)
        fitting = [p for p in POLICIES if c.fits[p]]
        assert c.policy == min(fitting, key=want.get)
        assert "dots" in fitting and "all" not in fitting  # every residual is more


def test_a_policy_over_the_limit_is_never_chosen(timed):
    """Keeping every residual is fastest by far, yet it stores more than the
    default policy's rows hold: the fastest of the others is chosen."""
    for p, t in zip(POLICIES, itertools.count(1)):
        timed[p] = dict.fromkeys(("F", "B", "W", "BW"), float(t))
    timed["all"] = dict.fromkeys(("F", "B", "W", "BW"), 0.01)
    for c in choose(split={2}):
        assert c.nbytes["all"] > c.nbytes["dots"] and not c.fits["all"]
        assert c.policy == "dots"  # second in POLICIES: the fastest that fits
        assert "all" in c.describe() and ">limit" in c.describe()


@pytest.mark.slow  # times nothing (fake timer) but compiles the pipeline
def test_remat_auto_pipeline_runs_the_chosen_policies(timed):
    for p, t in zip(POLICIES, itertools.count(1)):
        timed[p] = dict.fromkeys(("F", "B", "W", "BW"), float(t))
    timed["nothing"] = dict.fromkeys(("F", "B", "W", "BW"), 0.5)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = pp.boundary(jnp.tanh(nn.Dense(D)(x)))
            return nn.Dense(D)(x)

    m = 2
    x, y = data(m)
    pm = pp.pipeline(Model(), stages=2, microbatches=m, schedule="zb-h1", remat="auto")
    params = pm.init(jax.random.key(3), x)
    loss, grads = pm.value_and_grad(mse)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: mse(pm.module.apply(p, x), y)))(
        params
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)
    assert [c.policy for c in pm.stage_policies] == ["nothing", "nothing"]


def test_an_unknown_policy_names_the_allowed_ones():
    params, x_mb, y_mb = stage_chain()
    loss = LossLayout(mse).vector
    with pytest.raises(OptionError, match="policies: expected names from all, dots"):
        StageVjp([block] * 3, loss, params, x_mb, y_mb, policies=("dots", "fast", "dots"))
    with pytest.raises(OptionError, match="one residual policy per virtual stage"):
        StageVjp([block] * 3, loss, params, x_mb, y_mb, policies=("dots",))
