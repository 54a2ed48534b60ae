"""Tensor parallelism inside stages: weights split over the mesh's 'tensor' axis by
the model's own annotations, checked against plain jax.value_and_grad and optax."""

from __future__ import annotations

import dataclasses
import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss
from tests.numerics import rel_err
from tests.tiers import EXHAUSTIVE

CONFIG = dataclasses.replace(GPTConfig.tiny(), megatron=True)
MODEL = GPT(CONFIG)


def gpt_batch(n: int, seed: int = 0):
    tokens = jax.random.randint(jax.random.key(seed), (n, CONFIG.seq_len + 1), 0, CONFIG.vocab)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture(scope="module")
def boxed():
    return MODEL.init(jax.random.key(1), gpt_batch(2)[0])


def reference_grads(params, x, y):
    return jax.value_and_grad(lambda p: lm_loss(MODEL.apply(p, x), y))(params)


@pytest.mark.parametrize("kind", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_split_gpt_matches_value_and_grad(kind, boxed):
    x, y = gpt_batch(8)
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, schedule=kind, mesh=pp.make_mesh(2, 2, 2))
    loss, grads = pm.value_and_grad(lm_loss)(boxed, x, y)
    want_loss, want = reference_grads(nn.meta.unbox(boxed), x, y)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    kernel = grads["params"]["blocks_0"]["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.Partitioned) and kernel.names == (None, "tensor")
    assert rel_err(nn.meta.unbox(grads), want) <= 1e-5


def test_split_gpt_forward_matches_apply(boxed):
    x, _ = gpt_batch(8)
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(2, 2, 2))
    want = MODEL.apply(nn.meta.unbox(boxed), x)
    assert rel_err(pm.forward(boxed, x), want) <= 1e-5


def test_a_device_holds_its_slice_of_the_split_weights(boxed):
    x, y = gpt_batch(8)
    held = {}
    for T in (1, 2):
        pm = pp.pipeline(
            MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(2, 2, T), optimizer=optax.adam(1e-3)
        )
        state = pm.train_step(lm_loss).init(boxed, (x, y))
        held[T] = max(state.device_bytes().values())
        if T == 2:
            qkv = "float32|64x192|None,tensor|0"
            buf = state.device_params[qkv]
            assert {s.data.shape for s in buf.addressable_shards} == {(1, 1, 64, 96)}
    assert held[2] <= 0.6 * held[1], held


def test_split_adamw_steps_match_optax(boxed):
    # eps well above the gradients' rounding noise: the k bias of attention has a
    # zero true gradient, where adam's default eps would turn noise into steps.
    # The global-norm clip (below the gradients' norm) sees the whole model's norm.
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-3))
    batches = [gpt_batch(8, seed=s) for s in range(3)]
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(2, 2, 2), optimizer=opt)
    step = pm.train_step(lm_loss)
    state = step.init(boxed, batches[0])
    params = nn.meta.unbox(boxed)
    opt_state = opt.init(params)
    for x, y in batches:
        state, loss = step(state, (x, y))
        want, grads = reference_grads(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert abs(float(loss) - float(want)) <= 5e-5 * abs(float(want))
    got = state.params
    kernel = got["params"]["blocks_3"]["Dense_1"]["kernel"]
    assert isinstance(kernel, nn.Partitioned)
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec("tensor", None)
    assert rel_err(nn.meta.unbox(got), params) <= 5e-5


def test_a_tensor_size_that_does_not_divide_a_split_dimension_is_refused(boxed):
    x, y = gpt_batch(4)
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2, 3))
    with pytest.raises(
        pp.SplitError, match=r"proj.*kernel.*dimension 0 \(size 64\).*tensor size 3.*divides 64"
    ):
        pm.value_and_grad(lm_loss)(boxed, x, y)


class LogicalBlock(nn.Module):
    """x + down(relu(up(x))): up split on its output, down on its input, by logical names."""

    hidden: str = "mlp"

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        up = nn.with_logical_partitioning(init, ("embed", self.hidden))
        down = nn.with_logical_partitioning(init, (self.hidden, "embed"))
        h = nn.relu(nn.Dense(32, kernel_init=up, name="up")(x))
        return x + nn.Dense(8, kernel_init=down, name="down")(h)


class LogicalMLP(nn.Module):
    hidden: str = "mlp"

    def setup(self):
        self.blocks = [LogicalBlock(self.hidden) for _ in range(2)]

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


RULES = (("embed", None), ("mlp", "tensor"))


def test_logical_names_split_by_the_rules_and_unknown_ones_are_refused():
    x = np.asarray(jax.random.normal(jax.random.key(0), (8, 8)))
    y = np.asarray(jax.random.normal(jax.random.key(1), (8, 8)))
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    model = LogicalMLP()
    with nn.logical_axis_rules(RULES):
        params = model.init(jax.random.key(2), x)
        pm = pp.pipeline(model, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2, 2))
        loss, grads = pm.value_and_grad(mse)(params, x, y)
    plain = nn.meta.unbox(params)
    want_loss, want = jax.value_and_grad(lambda p: mse(model.apply(p, x), y))(plain)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert rel_err(nn.meta.unbox(grads), want) <= 1e-5
    bad = LogicalMLP(hidden="hiden")
    with nn.logical_axis_rules(RULES):
        params = bad.init(jax.random.key(2), x)
        pm = pp.pipeline(bad, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2, 2))
        with pytest.raises(
            pp.SplitError, match=r"blocks_0.*down.*kernel.*dimension 0.*'hiden'.*rules"
        ):
            pm.value_and_grad(mse)(params, x, y)


# ---- ZeRO over 'data' ----


def adamw_reference(batches, opt):
    params = nn.meta.unbox(MODEL.init(jax.random.key(1), gpt_batch(2)[0]))
    opt_state, losses = opt.init(params), []
    for x, y in batches:
        loss, grads = reference_grads(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, opt_state, losses


# test_zero_combos.py steps adamw under ZeRO on both meshes (its tied Llama on
# 2x2x2, its MLP over four replicas)
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("shape", [(4, 2, 1), (2, 2, 2)], ids=["4x2x1", "2x2x2"])
def test_zero_adamw_steps_match_optax(shape, boxed):
    opt = optax.adamw(1e-2, eps=1e-3)  # eps: see test_split_adamw_steps_match_optax
    batches = [gpt_batch(16, seed=s) for s in range(3)]
    D, P, T = shape
    pm = pp.pipeline(
        MODEL, stages=P, microbatches=2, mesh=pp.make_mesh(D, P, T), optimizer=opt, zero=True
    )
    step = pm.train_step(lm_loss)
    state = step.init(boxed, batches[0])
    want_params, want_opt, want_losses = adamw_reference(batches, opt)
    for batch, want in zip(batches, want_losses, strict=True):
        state, loss = step(state, batch)
        assert abs(float(loss) - want) <= 5e-5 * abs(want)
    assert rel_err(nn.meta.unbox(state.params), want_params) <= 5e-5
    # The optax state comes back in the module's layout, the slices joined.
    assert rel_err(state.opt_state, want_opt) <= 5e-5


def test_zero_holds_a_slice_of_the_optax_state(boxed):
    x, y = gpt_batch(16)
    held = {}
    for zero in (False, True):
        pm = pp.pipeline(
            MODEL,
            stages=2,
            microbatches=2,
            mesh=pp.make_mesh(4, 2),
            optimizer=optax.adam(1e-3),
            zero=zero,
        )
        held[zero] = max(pm.train_step(lm_loss).init(boxed, (x, y)).device_bytes().values())
    assert held[True] <= 0.75 * held[False], held


# ---- checkpoints across tensor sizes ----


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "zero_saved", "zero_resumed"),
    # the ZeRO level switched on resume: test_checkpoint.py resumes on other meshes too
    [("2x4", 3, 1), pytest.param("4x2", 1, 0, marks=EXHAUSTIVE)],
)
def test_a_run_saved_on_2x2x2_resumes_on_another_mesh(
    target, zero_saved, zero_resumed, tmp_path, capsys
):
    """5 steps of gpt-tiny on 2x2x2 (blocks split over 'tensor') saving at step 3,
    then the checkpoint resumed on a tensor=1 mesh at another ZeRO level: the
    uninterrupted losses."""
    from pjit_pipe.cli import main

    common = ["train", "--microbatches", "2", "--batch", "8", "--json", "--steps", "5"]
    directory = tmp_path / "ckpt"
    saving = ["--checkpoint-dir", str(directory), "--checkpoint-every", "3"]
    zero = lambda level: ["--zero", str(level)] if level else []  # noqa: E731
    assert main([*common, "--mesh", "2x2x2", *saving, *zero(zero_saved)]) == 0
    full = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    shutil.rmtree(directory / "5")  # as if the run had stopped after step 3
    resume = ["--mesh", target, "--checkpoint-dir", str(directory), *zero(zero_resumed)]
    assert main([*common, *resume]) == 0
    resumed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in resumed] == [3, 4]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in full[3:]], rtol=1e-4
    )


# ---- failures with the optax state in slices ----


def poisoned(buf, dead):
    """`buf` with the rows of the `dead` devices overwritten by NaN (-1 for integers)."""

    def row(shard):
        if shard.device not in dead:
            return shard.data
        bad = np.nan if np.issubdtype(buf.dtype, np.floating) else -1
        return jax.device_put(np.full(shard.data.shape, bad, buf.dtype), shard.device)

    rows = [row(s) for s in buf.addressable_shards]
    return jax.make_array_from_single_device_arrays(buf.shape, buf.sharding, rows)


def train_losing_failed_rows(pm, loss_fn, boxed, batches, fail, rejoin):
    """Train `batches` with ResilientTrainer under injected failures, turning a failed
    worker's rows to NaN as it fails (a read of them would show in the losses):
    (losses, final module-layout params, [(step, failed workers) of each switch])."""
    current = {}

    def lose_failed_devices(event, devices=pm.mesh.devices):
        if event.kind == "failure":
            dead = {d for w in event.failed for d in devices[w.replica, w.stage]}
            state = current["state"]
            for bufs in (state.device_params, state.device_opt):
                bufs.update({k: poisoned(b, dead) for k, b in bufs.items()})

    trainer = pp.ResilientTrainer(
        pm, loss_fn, pp.InjectedFailures(fail, rejoin), on_event=lose_failed_devices
    )
    state = trainer.init(boxed, batches[0], precompile=False)
    losses = []
    for batch in batches:
        current["state"] = state
        state, loss = trainer.step(state, batch)
        losses.append(float(loss))
    switches = [(e.step, sorted(e.failed)) for e in trainer.events if e.kind == "switch"]
    return losses, nn.meta.unbox(state.params), switches


@pytest.mark.slow
@pytest.mark.parametrize(
    # (2, 2, 2) with zero also covers tensor splits without it: the failure
    # variants run without ZeRO, on the joined state.
    ("shape", "zero"),
    [pytest.param((4, 2, 1), True, marks=EXHAUSTIVE), ((2, 2, 2), True), ((2, 2, 2), 3)],
)
def test_a_failure_and_rejoin_keep_the_fault_free_losses(shape, zero, boxed):
    """Worker (1, 0) (with tensor=2: its group of two devices) fails at step 2 (its
    rows turn to NaN, so reading them would break the run) and rejoins at step 4.
    With ZeRO its optax slice comes from the copy replica 0 keeps; losses and
    final params equal the run without failures."""
    batches = [gpt_batch(16, seed=s) for s in range(6)]
    runs = {}
    for name, fail, rejoin in (("clean", {}, {}), ("failing", {2: [(1, 0)]}, {4: [(1, 0)]})):
        pm = pp.pipeline(
            MODEL,
            stages=2,
            microbatches=2,
            mesh=pp.make_mesh(*shape),
            optimizer=optax.adamw(1e-2, eps=1e-3),
            zero=zero,
        )
        losses, params, switches = train_losing_failed_rows(
            pm, lm_loss, boxed, batches, fail, rejoin
        )
        runs[name] = (losses, params)
        assert switches == ([(2, [(1, 0)]), (4, [])] if fail else []), switches
    np.testing.assert_allclose(runs["failing"][0], runs["clean"][0], rtol=1e-5)
    assert rel_err(runs["failing"][1], runs["clean"][1]) <= 1e-5


# ---- NNX sharding metadata ----


def test_nnx_sharding_metadata_splits_the_weights():
    from flax import nnx

    init = nnx.initializers.lecun_normal()

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            up = nnx.with_partitioning(init, (None, "tensor"))
            down = nnx.with_partitioning(init, ("tensor", None))
            self.up = nnx.Linear(8, 32, kernel_init=up, rngs=rngs)
            self.down = nnx.Linear(32, 8, kernel_init=down, rngs=rngs)

        def __call__(self, x):
            return x + self.down(nnx.relu(self.up(x)))

    class Tower(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    mesh = pp.make_mesh(1, 2, 2)
    with jax.set_mesh(mesh):  # NNX places annotated weights eagerly
        model = Tower(nnx.Rngs(0))
    x = np.asarray(jax.random.normal(jax.random.key(0), (8, 8)))
    y = np.asarray(jax.random.normal(jax.random.key(1), (8, 8)))
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    want_loss, want = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
    pm = pp.pipeline(model, stages=2, microbatches=2, mesh=mesh, optimizer=optax.adam(1e-3))
    params = pm.init(jax.random.key(0), x)
    loss, grads = pm.value_and_grad(mse)(params, x, y)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert rel_err(grads, nnx.to_pure_dict(want)) <= 1e-5
    state = pm.train_step(mse).init(params, (x, y))
    assert "float32|8x32|None,tensor|0" in state.device_params
