"""Training semantics that span microbatches and stages, against unpipelined JAX/optax.

- a weighted (masked) loss `(loss_sum, weight)` with uneven weights: loss and
  gradients of sum(loss_sum) / sum(weight) over the global batch;
- `has_aux` metrics: the mean over microbatches;
- `optax.clip_by_global_norm` sees the whole model's norm: three steps equal
  plain optax; the staggered in-loop optimizer refuses it;
- dropout with `rngs=`: equal to an unpipelined step that uses the same
  per-microbatch keys.

The quick tests use two-stage pipelines (a mesh each); the full matrix
(2x4 and 1x4, 1f1b and zb-h1, four stages) is marked slow.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from test_lowering import CLASSES, MB, SEQ, VOCAB, tiny_model

import pjit_pipe as pp
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.schedules import make_schedule
from pjit_pipe.tick_packing.packer import pack_ticks
from tests.tiers import EXHAUSTIVE

MATRIX = [(D, kind) for D in (2, 1) for kind in ("1f1b", "zb-h1")]


def batch(n: int, seed: int):
    """Tokens, and labels with uneven per-example weights (some zero: padding)."""
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.randint(kx, (n, SEQ), 0, VOCAB)
    label = jax.random.randint(ky, (n,), 0, CLASSES)
    weight = jax.random.randint(kw, (n,), 0, 4).astype(jnp.float32)
    return x, {"label": label, "weight": weight}


def nll(logits, label):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), label[:, None], axis=1)[:, 0]


def weighted_loss(logits, y):
    return jnp.sum(nll(logits, y["label"]) * y["weight"]), jnp.sum(y["weight"])


def mean_loss(logits, y):
    return jnp.mean(nll(logits, y["label"]))


def run(fns, params, x):
    a = x
    for f, p in zip(fns, params, strict=True):
        a = f(p, a)
    return a


def reference_weighted(fns, params, x, y):
    """The unpipelined masked loss: sum over the global batch / total weight."""
    total, weight = weighted_loss(run(fns, params, x), y)
    return total / weight


def mesh_of(D: int, P: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: D * P]).reshape(D, P), ("data", "stage"))


def assert_trees_close(got, want, rel=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        scale = max(float(np.max(np.abs(b))), 1e-12)
        assert float(np.max(np.abs(a - b))) <= rel * scale, (a, b)


def weighted_loss_with_metrics(logits, y):
    correct = jnp.argmax(logits, axis=-1) == y["label"]
    return weighted_loss(logits, y), {"accuracy": jnp.mean(correct), "tokens": jnp.sum(y["weight"])}


def check_weighted(D: int, kind: str, P: int = 4, m: int = 4, costs: Costs | None = None):
    """The masked loss (with has_aux metrics) against the unpipelined ratio; with
    `costs`, the program runs the table packed under them. Returns the step."""
    fns, params = tiny_model(P)
    x, y = batch(D * m * MB, seed=1)
    sched = make_schedule(kind, P, m, replicas=D)
    loss_fn = weighted_loss_with_metrics
    ticks = sched if costs is None else pack_ticks(sched, costs)
    step = lower(ticks, fns, loss_fn, mesh_of(D, P), params, x, y, LoweringOptions(has_aux=True))
    (loss, aux), grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda p, x, y: reference_weighted(fns, p, x, y))
    )(params, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)
    # Metrics: the mean over the D*m microbatches of each microbatch's value.
    correct = np.asarray(jnp.argmax(run(fns, params, x), axis=-1) == y["label"])
    np.testing.assert_allclose(float(aux["accuracy"]), correct.mean(), rtol=1e-6)
    tokens = np.asarray(y["weight"]).reshape(D * m, MB).sum(axis=1).mean()
    np.testing.assert_allclose(float(aux["tokens"]), tokens, rtol=1e-6)
    # Not the mean of per-microbatch ratios (what averaging each microbatch would give).
    rows = [slice(i, i + MB) for i in range(0, len(x), MB)]
    ratios = [reference_weighted(fns, params, x[r], {k: a[r] for k, a in y.items()}) for r in rows]
    assert abs(float(np.nanmean(ratios)) - float(ref_loss)) > 1e-3
    return step


def test_weighted_loss_is_sum_over_total_weight():
    check_weighted(2, "zb-h1", P=2)


@pytest.mark.slow
@pytest.mark.parametrize(("D", "kind"), MATRIX)
def test_weighted_loss_matrix(D, kind):
    check_weighted(D, kind)


def plain_optax(fns, params, opt, batches):
    state = opt.init(params)
    grad = jax.jit(jax.grad(lambda p, x, y: mean_loss(run(fns, p, x), y)))
    for x, y in batches:
        g = grad(params, x, y)
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
    return params


def check_clipped(
    D: int, opt: optax.GradientTransformation, P: int = 4, m: int = 4, kind="1f1b", v: int = 1
):
    """Three steps with a clip that is active (the global norm is above it, some
    stages' own norms below) against plain optax on the whole model."""
    fns, params = tiny_model(P * v)
    batches = [batch(D * m * MB, seed=10 + i) for i in range(3)]
    step = lower(
        make_schedule(kind, P, m, chunks=v, replicas=D),
        fns,
        mean_loss,
        mesh_of(D, P),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt),
    )
    got, state = params, step.init_opt_state(params)
    for x, y in batches:
        got, state, _ = step.train_step(got, state, x, y)
    assert_trees_close(got, plain_optax(fns, params, opt, batches))


def clipped(opt: str) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(0.3), getattr(optax, opt)(0.05))


def test_clip_by_global_norm_sees_the_whole_model():
    # Two norm calls, the second of adam's updates (which depend on the first).
    check_clipped(2, optax.chain(clipped("adam"), optax.clip_by_global_norm(0.1)), P=2)


# A clipped sgd under every kind and mesh: test_combination_matrix.py.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("D", "opt"),
    [(2, "adam"), pytest.param(1, "adam", marks=EXHAUSTIVE)]
    + [pytest.param(D, "sgd", marks=EXHAUSTIVE) for D in (2, 1)],
    ids=["2x4-adam", "1x4-adam", "2x4-sgd", "1x4-sgd"],
)
def test_clip_by_global_norm_matrix(D, opt):
    check_clipped(D, clipped(opt))


@pytest.mark.slow
@pytest.mark.exhaustive  # two chunks under a clip: test_combination_matrix.py
def test_clip_by_global_norm_with_two_chunks_per_device():
    check_clipped(2, clipped("sgd"), P=2, kind="interleaved-1f1b", v=2)


def test_global_norm_clip_refused_in_the_staggered_loop():
    fns, params = tiny_model(4)  # refused before anything compiles
    x, y = batch(4 * MB, seed=3)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    with pytest.raises(ValueError, match="clip_by_global_norm"):
        lower(
            PackedTicks.one_op_per_tick(make_schedule("1f1b", 4, 4), 2),
            fns,
            mean_loss,
            mesh_of(1, 4),
            params,
            x,
            y,
            LoweringOptions(optimizer=opt),
        )


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, h):
        return nn.Dropout(0.3, deterministic=False)(jnp.tanh(nn.Dense(self.width)(h)))


class DropoutNet(nn.Module):
    """Embedding, four dense blocks with dropout, a classifier: cut into 2 or 4 stages."""

    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, 8)(x).mean(axis=1)
        for _ in range(4):
            h = Block(8)(h)
        return nn.Dense(CLASSES)(h)


def per_microbatch_reference(model, params, x, y, key, count):
    """Unpipelined: microbatch i applies the model with rngs fold_in(key, i)."""
    n = len(x) // count

    def loss(params):
        losses = [
            mean_loss(
                model.apply(
                    params, x[i * n : (i + 1) * n], rngs={"dropout": jax.random.fold_in(key, i)}
                ),
                {k: a[i * n : (i + 1) * n] for k, a in y.items()},
            )
            for i in range(count)
        ]
        return jnp.mean(jnp.stack(losses))

    return jax.jit(jax.value_and_grad(loss))(params)


def check_dropout(D: int, kind: str, P: int = 4, m: int = 4):
    model = DropoutNet()
    x, y = batch(D * m * MB, seed=4)
    params = model.init(jax.random.key(0), x)
    pm = pp.pipeline(
        model, stages=P, microbatches=m, schedule=kind, mesh=pp.make_mesh(data=D, stage=P)
    )
    key = jax.random.key(7)
    loss, grads = pm.value_and_grad(mean_loss)(params, x, y, rngs=key)
    ref_loss, ref_grads = per_microbatch_reference(model, params, x, y, key, D * m)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)
    return pm, params, (x, y), (loss, grads)


def test_dropout_uses_the_same_keys_per_microbatch():
    pm, params, (x, y), (loss, _) = check_dropout(1, "zb-h1", P=2)
    _, step = pm.program(params, x, y, mean_loss, rngs={"dropout": jax.random.key(7)})
    assert step._low.st.split == {1}  # keys and all: W only transposes the sites
    again, _ = pm.value_and_grad(mean_loss)(params, x, y, rngs={"dropout": jax.random.key(7)})
    other, _ = pm.value_and_grad(mean_loss)(params, x, y, rngs=jax.random.key(8))
    assert float(again) == float(loss)  # reproducible
    assert abs(float(other) - float(loss)) > 1e-4  # the masks do depend on the key
    with pytest.raises(ValueError, match="rngs"):
        pm.value_and_grad(mean_loss)(params, x, y)


@pytest.mark.slow
@pytest.mark.parametrize(("D", "kind"), [(2, "zb-h1"), (1, "1f1b")])  # two corners: time budget
def test_dropout_matrix(D, kind):
    check_dropout(D, kind)


def test_pipelined_forward_returns_the_outputs():
    model, D, m = DropoutNet(), 2, 2
    x, _ = batch(D * m * MB, seed=5)
    params = model.init(jax.random.key(0), x)
    pm = pp.pipeline(
        model, stages=2, microbatches=m, schedule="zb-h1", mesh=pp.make_mesh(data=D, stage=2)
    )
    key = jax.random.key(3)
    got = pm.forward(params, x, rngs=key)
    want = jnp.concatenate(
        [
            model.apply(
                params, x[i * MB : (i + 1) * MB], rngs={"dropout": jax.random.fold_in(key, i)}
            )
            for i in range(D * m)
        ]
    )
    assert got.shape == want.shape
    assert_trees_close(got, want, rel=1e-6)


def test_weighted_loss_with_the_optimizer_inside_the_loop():
    """iterations=2: each stage steps inside the tick loop, as soon as its gradients
    are complete; the gradients are divided by the iteration's total weight first."""
    fns, params = tiny_model(2)
    batches = [batch(4 * MB, seed=20 + i) for i in range(2)]
    opt = optax.sgd(0.5, momentum=0.9)  # unlike adam, it sees the gradients' scale
    xs, ys = jax.tree.map(lambda *a: jnp.stack(a), *batches)
    step = lower(
        PackedTicks.one_op_per_tick(make_schedule("zb-h1", 2, 4), 2),
        fns,
        weighted_loss,
        mesh_of(1, 2),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt),
    )
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    want, state, want_losses = params, opt.init(params), []
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, x, y: reference_weighted(fns, p, x, y)))
    for x, y in batches:
        loss, g = value_and_grad(want, x, y)
        upd, state = opt.update(g, state, want)
        want = optax.apply_updates(want, upd)
        want_losses.append(float(loss))
    np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=1e-5)
    assert_trees_close(got, want)


def test_a_train_step_follows_the_batch_shape_from_step_to_step():
    """One TrainStep given global batches of 8, 16 and again 8 rows runs the program
    of each shape (the second one built at its first step, the first found again),
    and its losses and parameters equal plain optax on the same batches."""
    model = nn.Sequential([nn.Dense(6), nn.Dense(5), nn.Dense(2)])
    opt = optax.adam(0.05)
    pm = pp.pipeline(model, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2), optimizer=opt)
    keys = jax.random.split(jax.random.key(3), 6)
    batches = [
        (jax.random.normal(keys[2 * i], (n, 3)), jax.random.normal(keys[2 * i + 1], (n, 2)))
        for i, n in enumerate((8, 16, 8))
    ]
    params = model.init(jax.random.key(4), batches[0][0])
    step = pm.train_step(lambda out, y: jnp.mean((out - y) ** 2), donate=False)
    state = step.init(params, batches[0])
    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))

    def plain_loss(p, x, y):
        return jnp.mean((model.apply(p, x) - y) ** 2)

    want, opt_state, want_losses = params, opt.init(params), []
    for x, y in batches:
        loss, g = jax.value_and_grad(plain_loss)(want, x, y)
        upd, opt_state = opt.update(g, opt_state, want)
        want = optax.apply_updates(want, upd)
        want_losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(state.params, want)
