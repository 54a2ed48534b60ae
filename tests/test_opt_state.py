"""The optimizer state lives in the module's layout: split by stage, merged back."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.frontend.opt_state import check_opt_layout, merge_opt_state, split_opt_state

MODEL = nn.Sequential([nn.Dense(6), nn.Dense(5), nn.Dense(4), nn.Dense(2)])
X = jax.random.normal(jax.random.key(0), (8, 3))
Y = jax.random.normal(jax.random.key(1), (8, 2))
PARAMS = MODEL.init(jax.random.key(2), X)


def is_matrix(p):
    return jax.tree.map(lambda a: a.ndim > 1, p)


def label(p):
    return jax.tree.map(lambda a: "matrix" if a.ndim > 1 else "vector", p)


OPTIMIZERS = {
    "adam": optax.adam(1e-2),
    "clip+momentum": optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)),
    "adamw": optax.adamw(1e-2),
    "masked": optax.masked(optax.adam(1e-2), is_matrix),
    "multi_transform": optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.1, momentum=0.9)}, label
    ),
}


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@pytest.fixture(scope="module")
def cut():
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2))
    return pm.cut(PARAMS, X)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_split_gives_each_stage_its_own_state_and_merge_inverts_it(cut, name):
    opt = OPTIMIZERS[name]
    check_opt_layout(cut, opt, PARAMS)
    state = opt.init(PARAMS)
    parts = split_opt_state(cut, state, PARAMS)
    for part, stage_params in zip(parts, cut.split(PARAMS), strict=True):
        # Each part is what the optimizer itself makes for that stage's parameters.
        assert jax.tree.structure(part) == jax.tree.structure(opt.init(stage_params))
    back = merge_opt_state(cut, parts, state, PARAMS)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert all(
        bool(jnp.all(a == b))
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True)
    )


def test_a_mask_tree_for_the_whole_model_is_refused(cut):
    opt = optax.masked(optax.adam(1e-2), is_matrix(PARAMS))
    with pytest.raises(ValueError, match="function of the parameters"):
        check_opt_layout(cut, opt, PARAMS)


def test_training_with_multi_transform_matches_unpipelined():
    opt = OPTIMIZERS["multi_transform"]
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2), optimizer=opt)
    step = pm.train_step(mse)
    state = step.init(PARAMS, (X, Y))
    params, opt_state = PARAMS, opt.init(PARAMS)
    ref_value_and_grad = jax.jit(jax.value_and_grad(lambda p: mse(MODEL.apply(p, X), Y)))
    for _ in range(3):
        state, loss = step(state, (X, Y))
        ref_loss, g = ref_value_and_grad(params)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(opt_state)
    for a, b in zip(
        jax.tree.leaves((state.params, state.opt_state)),
        jax.tree.leaves((params, opt_state)),
        strict=True,
    ):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * (float(jnp.max(jnp.abs(b))) + 1e-6)
