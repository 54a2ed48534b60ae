"""A stage computation traced once is replayed, not traced again: by later calls
of one program, and by programs on other meshes (failure variants). The values
are those of the function itself (jax.value_and_grad as the reference), and
microbatch keys are inputs of the replayed jaxpr, not constants baked into it
(a dropout pipeline against an unpipelined per-microbatch reference)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

import pjit_pipe as pp
from pjit_pipe.lowering.compute.replay import TracedOnce
from pjit_pipe.lowering.compute.rng import current_rngs, microbatch_rngs


class Counted:
    """fn with a count of the times Python ran it (each trace runs it once)."""

    def __init__(self, fn):
        self.fn, self.runs = fn, 0

    def __call__(self, *args):
        self.runs += 1
        return self.fn(*args)


def close(got, want):
    """Equal up to float32 rounding (the compiled program fuses what eager runs op by op)."""
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5), got, want)


def dense_value_and_grad(params, x):
    loss = lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)  # noqa: E731
    return jax.value_and_grad(loss)(params)


def test_one_trace_per_signature_and_the_functions_values():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    fn = Counted(dense_value_and_grad)
    replayed = TracedOnce(fn)
    step = jax.jit(lambda p, x: replayed(p, x))
    for _ in range(2):
        x = rng.normal(size=(5, 4)).astype(np.float32)
        got = step(params, x)
        close(got, dense_value_and_grad(params, x))
        x2 = rng.normal(size=(5, 4)).astype(np.float32)
        close(step(params, x2), dense_value_and_grad(params, x2))
    # jit traced `step` once; a fresh trace of another function replays too
    jax.jit(lambda p, x: replayed(p, x)[1]).trace(params, x)
    assert fn.runs == 1
    replayed(params, np.zeros((7, 4), np.float32))  # another shape: traced anew
    assert fn.runs == 2


def test_programs_on_other_meshes_replay_the_first_trace():
    devices = jax.devices()
    rng = np.random.default_rng(1)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": np.ones(3, np.float32)}
    fn = Counted(dense_value_and_grad)
    replayed = TracedOnce(fn)
    for shape in ((2, 4), (1, 7)):  # a fault-free mesh, then a survivors' one
        n = shape[0] * shape[1]
        mesh = jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), ("data", "stage"))
        body = lambda p, x: jax.tree.map(lambda a: a[None], replayed(p, x[0]))  # noqa: E731
        f = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(PS(), PS(("data", "stage"))),
            out_specs=PS(("data", "stage")),
            check_vma=False,
        )
        xs = rng.normal(size=(n, 5, 4)).astype(np.float32)
        loss, grads = jax.jit(f)(params, xs)
        for d in range(n):
            close(
                (loss[d], jax.tree.map(lambda g, d=d: g[d], grads)),
                dense_value_and_grad(params, xs[d]),
            )
    assert fn.runs == 1


def test_microbatch_keys_are_inputs_of_the_replayed_jaxpr():
    def noisy(x):
        return x + jax.random.normal(current_rngs()["dropout"], x.shape)

    fn = Counted(noisy)
    replayed = TracedOnce(fn)
    impls = {"dropout": jax.random.key_impl(jax.random.key(0))}
    x = jnp.zeros(3)
    for seed in (1, 2):
        data = {"dropout": jax.random.key_data(jax.random.key(seed))}
        with microbatch_rngs(data, impls):
            got = replayed(x)
        np.testing.assert_array_equal(got, jax.random.normal(jax.random.key(seed), (3,)))
    assert fn.runs == 1


class CountedBlock(nn.Module):
    """A dense residual block, with dropout at rate `dropout`; `calls` counts the
    times Python ran one."""

    dropout: float = 0.0
    calls = 0

    @nn.compact
    def __call__(self, x):
        CountedBlock.calls += 1
        x = x + jnp.tanh(nn.Dense(8)(x))
        return nn.Dropout(self.dropout, deterministic=not self.dropout)(x)


class CountedMLP(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = CountedBlock(self.dropout)(x)
        return x


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def fault_free_and_variant(model, x, y, rngs=None, remat=False):
    """value_and_grad of a 2x2 zb-h1 pipeline, fault-free and with worker 1:1 down;
    the variant, built after the fault-free program, runs no stage module."""
    params = model.init(jax.random.key(0), x)
    pm = pp.pipeline(
        model,
        stages=2,
        microbatches=2,
        schedule="zb-h1",
        mesh=pp.make_mesh(data=2, stage=2),
        remat=remat,
    )
    want = pm.value_and_grad(mse)(params, x, y, rngs)
    CountedBlock.calls = 0
    got = pm.with_failures([(1, 1)]).value_and_grad(mse)(params, x, y, rngs)
    assert CountedBlock.calls == 0
    return params, want, got


@pytest.mark.parametrize("remat", [False, True])
def test_a_failure_variant_runs_no_stage_module_and_matches_the_fault_free_step(remat):
    x = np.random.default_rng(2).normal(size=(8, 8)).astype(np.float32)
    _, want, got = fault_free_and_variant(CountedMLP(), x, np.zeros_like(x), remat=remat)
    close(got, want)


def test_a_dropout_pipelines_variant_runs_no_stage_module_and_uses_each_microbatchs_keys():
    model, key, count = CountedMLP(dropout=0.3), jax.random.key(7), 4  # D * m microbatches
    x = np.random.default_rng(3).normal(size=(8, 8)).astype(np.float32)
    y = np.zeros_like(x)
    params, _, got = fault_free_and_variant(model, x, y, rngs=key)

    def reference(params):  # microbatch i applies the model with fold_in(key, i)
        n = len(x) // count
        return jnp.mean(
            jnp.stack(
                [
                    mse(
                        model.apply(
                            params,
                            x[i * n : (i + 1) * n],
                            rngs={"dropout": jax.random.fold_in(key, i)},
                        ),
                        y[i * n : (i + 1) * n],
                    )
                    for i in range(count)
                ]
            )
        )

    close(got, jax.value_and_grad(reference)(params))
