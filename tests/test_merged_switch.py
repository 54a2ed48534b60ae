"""merged_switch: equal branches share one compiled branch, different ones never do."""

import re

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import pjit_pipe as pp
from pjit_pipe.lowering.compute.merged_switch import merged_switch
from pjit_pipe.models import GPT, GPTConfig, lm_loss


def branch_counts(fn, *args) -> list[int]:
    """The number of branches of each conditional in `fn`'s jaxpr (top level)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [len(e.params["branches"]) for e in jaxpr.eqns if e.primitive.name == "cond"]


def scaled(k):
    """A fresh closure each call: equal computations that are different functions."""
    return lambda x, y: (jnp.tanh(x) * k + y, x.sum())


def test_equal_branches_share_one_and_every_index_gives_lax_switch():
    branches = [scaled(2.0), scaled(3.0), scaled(2.0), scaled(2.0)]
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))

    def merged(i, x, y):
        return merged_switch(i, branches, x, y)

    assert branch_counts(merged, 0, x, y) == [2]
    for i in range(-1, len(branches) + 1):  # out-of-range indices clamp, as lax.switch's
        want = lax.switch(i, branches, x, y)
        got = jax.jit(merged)(i, x, y)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_branches_that_differ_only_in_an_array_constant_stay_apart():
    tables = [np.arange(4.0), np.arange(4.0), np.arange(4.0)[::-1].copy()]
    branches = [lambda x, t=t: x * jnp.asarray(t) for t in tables]
    x = jnp.ones(4)
    assert branch_counts(lambda i, x: merged_switch(i, branches, x), 0, x) == [2]
    for i, t in enumerate(tables):
        np.testing.assert_array_equal(jax.jit(lambda i, x: merged_switch(i, branches, x))(i, x), t)


def test_branches_closing_over_different_traced_values_stay_apart():
    def program(i, a, b, x):
        return merged_switch(i, [lambda x: x + a, lambda x: x + b, lambda x: x + a], x)

    args = (jnp.float32(1.0), jnp.float32(10.0), jnp.float32(0.5))
    assert branch_counts(program, 0, *args) == [2]
    got = [float(jax.jit(program)(i, *args)) for i in range(3)]
    assert got == [1.5, 10.5, 1.5]


def test_branches_that_differ_only_in_dead_code_share_one():
    def live(x):
        return x * 2.0

    def with_dead(x):
        jnp.zeros((3, 5)) + x.sum()  # computed and dropped
        return x * 2.0

    x = jnp.arange(3.0)
    assert branch_counts(lambda i, x: merged_switch(i, [live, with_dead], x), 0, x) == []


@pytest.mark.parametrize("count", [1, 3])
def test_one_distinct_branch_runs_without_a_conditional(count):
    branches = [scaled(2.0) for _ in range(count)]
    x, y = jnp.ones(3), jnp.zeros(3)
    assert branch_counts(lambda i, x, y: merged_switch(i, branches, x, y), 0, x, y) == []
    got = jax.jit(lambda i, x, y: merged_switch(i, branches, x, y))(count - 1, x, y)
    np.testing.assert_allclose(got[0], jnp.tanh(x) * 2.0)


def test_a_gpt_s_middle_stages_compile_as_one():
    """On 4 stages the tiny GPT has 3 distinct stages (embedding + blocks, blocks,
    blocks + head): the train step runs stage 1's ops for stage 2 (the ops are
    named by kind and stage, tick_ops.py), and each of the others' own."""
    config = GPTConfig.tiny(vocab=32)
    model = GPT(config)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 32, size=(8, config.seq_len)).astype(np.int32)
    y = rng.integers(0, 32, size=(8, config.seq_len)).astype(np.int32)
    pm = pp.pipeline(
        model,
        stages=4,
        microbatches=4,
        schedule="zb-h1",
        mesh=pp.make_mesh(data=2, stage=4),
        optimizer=optax.adam(1e-3),
    )
    step = pm.train_step(lm_loss)
    state = step.init(model.init(jax.random.key(0), x[:1]), (x, y))
    program, _ = step._state_program(state, (x, y))
    jitted = program._device_steps[(False, step._skips(program))].jitted
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.update(re.findall(r"\b[FBW] stage \d", str(eqn.source_info.name_stack)))
        for sub in jex.subjaxprs(jaxpr):
            walk(sub)

    walk(jitted.trace(*program.layout.avals(), x, y).jaxpr.jaxpr)
    assert names == {f"{kind} stage {s}" for kind in "FBW" for s in (0, 1, 3)}
