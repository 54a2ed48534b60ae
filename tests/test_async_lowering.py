"""The compiled asynchronous 1F1B program: weight modes predict, stash and latest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import pjit_pipe as pp
from pjit_pipe.errors import OptionError
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.lockstep import iteration_ticks
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.lowering.async_pipeline.async_weights import AsyncWeights, staleness
from pjit_pipe.schedules import make_schedule
from pjit_pipe.schedules.asynchronous import async_one_f_one_b
from pjit_pipe.tick_packing.packer import pack_ticks
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


def train_iterations(problem, sched, mode: str, ticks=None):
    """(compiled step, parameters, per-iteration losses) after the ITERS iterations of
    `problem`'s batches, run in one call of `sched` lowered with `mode` weights."""
    fns, params, batches, opt, _ = problem
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    step = lower(
        ticks or PackedTicks.one_op_per_tick(sched, ITERS),
        fns,
        xent,
        mesh_of(1, P),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt, async_weights=mode),
    )
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    return step, got, losses


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["predict", "stash", "latest"])
def test_zero_staleness_is_per_microbatch_sgd(problem, mode):
    *_, (ref_params, ref_losses) = problem
    _, got, losses = train_iterations(problem, async_one_f_one_b(P, M, stale=False), mode)
    np.testing.assert_allclose(np.asarray(losses), ref_losses, rtol=1e-5)
    assert_trees_close(got, ref_params)


def host_async_training(fns, params, opt, batches, sched, mode):
    """The asynchronous program's arithmetic, op by op on the host, in its lockstep order.

    Each stage's weights change only at its own OPTs, right after its backward;
    a forward reads W (latest, stash) or W + s*u (predict), a backward reads W
    or, with stash, the version its forward read. Returns (params, loss per iteration).
    """
    W = list(params)
    state = [opt.init(p) for p in W]
    last_upd = [jax.tree.map(jnp.zeros_like, p) for p in W]
    s = [staleness(sched, p) for p in range(P)]
    inputs, versions, cot = {}, {}, {}
    losses = np.zeros(ITERS)
    for tick in iteration_ticks(sched, ITERS):
        for it, op in tick.values():
            p, key = op.stage, (it, op.mb)
            x, y = batches[it]
            part = slice(op.mb * MB, (op.mb + 1) * MB)
            if op.kind is Kind.F:
                w = W[p]
                if mode == "predict":
                    w = jax.tree.map(lambda a, b, sp=s[p]: a + sp * b, w, last_upd[p])
                versions[(p, key)] = W[p]
                a = x[part] if p == 0 else inputs[(p, key)]
                inputs[(p, key)] = a
                out = fns[p](w, a)
                if p == P - 1:
                    losses[it] += float(xent(out, y[part])) / M
                else:
                    inputs[(p + 1, key)] = out
                continue
            w = versions[(p, key)] if mode == "stash" else W[p]
            a, f = inputs[(p, key)], fns[p]
            if p == P - 1:
                loss = lambda w, a, f=f, t=y[part]: xent(f(w, a), t)  # noqa: E731
                gw, ga = jax.grad(loss, argnums=(0, 1))(w, a)
            elif p == 0:
                _, pull = jax.vjp(lambda w, f=f, a=a: f(w, a), w)
                (gw,), ga = pull(cot[(p, key)]), None
            else:
                _, pull = jax.vjp(fns[p], w, a)
                gw, ga = pull(cot[(p, key)])
            if p > 0:
                cot[(p - 1, key)] = ga
            upd, state[p] = opt.update(gw, state[p], W[p])
            new = optax.apply_updates(W[p], upd)
            last_upd[p] = jax.tree.map(jnp.subtract, new, W[p])
            W[p] = new
    return W, list(losses)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["predict", "stash"])
def test_stale_weights_follow_the_schedule(problem, mode):
    """With real staleness (s = 1 on stage 0), each mode reads the weights it should."""
    fns, params, batches, opt, _ = problem
    sched = make_schedule("async-1f1b", P, M)
    # the frontend's path: a packed (checked) table
    step, got, losses = train_iterations(
        problem, sched, mode, pack_ticks(sched, Costs(1, 2, 1), ITERS)
    )
    # the extra copies: predict keeps the last update, stash a version per in-flight slot
    row = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params[0]))
    copies = step.async_weight_bytes() / row
    assert copies == {"predict": 1, "stash": P + 1}[mode]
    want, want_losses = host_async_training(fns, params, opt, batches, sched, mode)
    np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=1e-5)
    assert_trees_close(got, want)
    # and the mode matters: reading the latest weights everywhere gives other numbers
    latest, _ = host_async_training(fns, params, opt, batches, sched, "latest")
    assert not np.allclose(np.asarray(got[0]["emb"]), np.asarray(latest[0]["emb"]), rtol=1e-4)


def test_bad_async_requests_are_rejected():
    sched = make_schedule("async-1f1b", 2, 2)
    avals = [{"w": jax.ShapeDtypeStruct((3, 3), jnp.float32)}] * 2
    with pytest.raises(ValueError, match="supports sgd, sgd with momentum, adam, adamw, rmsprop"):
        AsyncWeights("predict", sched, optax.lion(1e-3), avals, remat=False)
    AsyncWeights("stash", sched, optax.lion(1e-3), avals, remat=False)  # any optimizer
    # the paper's s by default; PipeOptim's code predicts one step further
    paper = AsyncWeights("predict", sched, optax.adam(1e-3), avals, remat=False)
    code = AsyncWeights("predict", sched, optax.adam(1e-3), avals, False, staleness_offset=1)
    assert list(paper.horizon) == [1, 0] and list(code.horizon) == [2, 1]
    with pytest.raises(ValueError, match="one of predict, stash, latest"):
        AsyncWeights("newest", sched, optax.sgd(0.1), avals, remat=False)
    with pytest.raises(ValueError, match="remat"):
        AsyncWeights("stash", sched, optax.sgd(0.1), avals, remat=True)
    # pipeline() checks the option when it is given (PipelineOptions), before any trace
    with pytest.raises(OptionError, match="applies to schedule='async-1f1b' only"):
        pp.pipeline(nn.Dense(3), stages=2, microbatches=2, async_weights="predict")
    with pytest.raises(OptionError, match="async_weights: expected one of predict, stash, latest"):
        pp.pipeline(
            nn.Dense(3), stages=2, microbatches=2, schedule="async-1f1b", async_weights="newest"
        )
    opts = pp.pipeline(nn.Dense(3), stages=2, microbatches=2, schedule="async-1f1b").options
    assert opts.async_weights is None  # lower() reads None as "predict"
