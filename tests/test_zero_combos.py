"""ZeRO with a global-norm clip, ZeRO with tied weights and tensor parallelism
with tied weights train like plain `jax.value_and_grad` + optax for three steps.

The clip's threshold sits below the models' gradient norms, so it scales every
step: a norm that missed a slice, counted a tied copy twice or counted a
replicated buffer once per replica would change the numbers. The models come
from `pjit_pipe.models`: a plain residual MLP stack, GPT-2 (its embedding tied
to the head) and Llama (an `nn.scan` stack with Megatron annotations, here
with its embedding tied to the head, so the tied leaf is split over 'tensor').

What stays refused (the optimizer inside the tick loop with ZeRO) is refused by
name before anything compiles.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from test_fused_loss import mesh_of, tiny_model, xent
from test_lowering import batch

import pjit_pipe as pp
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.models import GPT2LM, GPT2Config, ResidualMLP, gpt2_batch, mse_loss
from pjit_pipe.models.llama import Llama, LlamaConfig
from pjit_pipe.models.llama import lm_loss as llama_loss
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule
from tests.numerics import rel_err
from tests.tiers import EXHAUSTIVE

BATCH = 16  # global rows: D x microbatches x rows per microbatch
STEPS = 3
CLIP = 0.05  # below the models' gradient norms: the clip acts every step
TOL = 1e-5

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, eps=1e-3),  # eps: tiny second moments stay tame
}


@functools.cache
def problem(name: str) -> tuple[nn.Module, Any, Any, list]:
    """(module, boxed params, loss_fn, STEPS batches) of a tiny model: "mlp",
    "tied-gpt2", "llama" or "tied-llama"."""
    keys = jax.random.split(jax.random.key(11), STEPS + 1)
    if name == "mlp":
        module, loss_fn = ResidualMLP(d_model=16, hidden=32, n_layers=4, d_out=8), mse_loss
        batches = []
        for k in keys[1:]:
            x = jax.random.normal(k, (BATCH, 16))
            batches.append((x, jnp.sin(x[:, :8])))
    elif name == "tied-gpt2":
        config = GPT2Config(vocab=32, n_positions=8, d_model=16, n_heads=2, n_layers=4)
        module, loss_fn = GPT2LM(config), llama_loss
        batches = [gpt2_batch(k, BATCH, config) for k in keys[1:]]
    else:
        config = LlamaConfig.tiny(
            vocab=32,
            seq_len=8,
            d_model=32,
            n_heads=4,
            n_kv_heads=2,
            n_layers=4,
            d_ff=64,
            tie_embeddings=name == "tied-llama",
        )
        module, loss_fn = Llama(config), llama_loss
        batches = []
        for k in keys[1:]:
            tokens = jax.random.randint(k, (BATCH, config.seq_len + 1), 0, config.vocab)
            batches.append((tokens[:, :-1], tokens[:, 1:]))
    x0 = batches[0][0]
    init = (
        (lambda k: module.init(k, **x0)) if isinstance(x0, dict) else (lambda k: module.init(k, x0))
    )
    return module, jax.jit(init)(keys[0]), loss_fn, batches


def optimizer(name: str, clip: bool) -> optax.GradientTransformation:
    opt = OPTIMIZERS[name]()
    return optax.chain(optax.clip_by_global_norm(CLIP), opt) if clip else opt


@functools.cache
def optax_run(model: str, opt_name: str, clip: bool) -> tuple[list[float], Any]:
    """Losses and final params of STEPS unpipelined value_and_grad + optax steps."""
    module, boxed, loss_fn, batches = problem(model)
    params, opt = nn.meta.unbox(boxed), optimizer(opt_name, clip)

    def loss_of(p, x, y):
        out = module.apply(p, **x) if isinstance(x, dict) else module.apply(p, x)
        return loss_fn(out, y)

    @jax.jit
    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(loss_of)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    state, losses = opt.init(params), []
    for x, y in batches:
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return losses, params


def check(
    model: str,
    kind: str,
    mesh: tuple[int, int, int],
    zero: bool,
    opt_name: str,
    failed: tuple[tuple[int, int], ...] = (),
    grad_sum: str = "accumulator",
):
    """Three pipelined steps with a global-norm clip equal optax's (on the
    survivors of `failed`: the re-routed program), summing the microbatches'
    gradients as `grad_sum` says."""
    module, boxed, loss_fn, batches = problem(model)
    D, P, T = mesh
    chunks = 2 if kind == "interleaved-1f1b" else None  # zb-v: its own two
    pm = pp.pipeline(
        module,
        stages=P,
        microbatches=BATCH // D // 2,
        schedule=kind,
        chunks=chunks,
        mesh=pp.make_mesh(data=D, stage=P, tensor=T),
        optimizer=optimizer(opt_name, clip=True),
        zero=zero,
        failed=failed,
        grad_sum=grad_sum,
    )
    step = pm.train_step(loss_fn)
    state = step.init(boxed, batches[0])
    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))
    want_losses, want_params = optax_run(model, opt_name, True)
    for got, want in zip(losses, want_losses, strict=True):
        assert abs(got - want) <= TOL * abs(want), (losses, want_losses)
    assert rel_err(nn.meta.unbox(state.params), want_params) <= TOL


@pytest.mark.parametrize(
    ("model", "kind", "mesh", "opt_name"),
    [
        ("mlp", "1f1b", (4, 2, 1), "adamw"),
        # tied weights under ZeRO and a clip: the matrix's tied GPT-2 rows
        pytest.param("tied-gpt2", "zb-h1", (4, 2, 1), "sgd", marks=EXHAUSTIVE),
    ],
    ids=["mlp-1f1b-4x2x1-adamw", "tied-gpt2-zb-h1-4x2x1-sgd"],
)
def test_zero_with_a_global_norm_clip_trains_like_optax(model, kind, mesh, opt_name):
    check(model, kind, mesh, zero=True, opt_name=opt_name)


# The tied Llama (its tied leaf split over 'tensor') with and without ZeRO; the
# other rows' pairs of kind, mesh, ZeRO and a tied model are in
# test_combination_matrix.py, and ZeRO over four replicas with a clip above.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "kind", "mesh", "zero", "opt_name"),
    [
        pytest.param("mlp", "zb-h1", (4, 2, 1), True, "sgd", marks=EXHAUSTIVE),
        pytest.param("mlp", "1f1b", (2, 2, 2), True, "sgd", marks=EXHAUSTIVE),
        pytest.param("tied-gpt2", "1f1b", (4, 2, 1), True, "adamw", marks=EXHAUSTIVE),
        pytest.param("tied-gpt2", "zb-h2", (4, 2, 1), True, "sgd", marks=EXHAUSTIVE),
        pytest.param("tied-gpt2", "interleaved-1f1b", (2, 2, 1), True, "sgd", marks=EXHAUSTIVE),
        ("tied-llama", "zb-h1", (2, 2, 2), True, "adamw"),
        pytest.param("tied-llama", "1f1b", (2, 2, 2), True, "sgd", marks=EXHAUSTIVE),
        ("tied-llama", "1f1b", (1, 2, 2), False, "sgd"),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_zero_tied_and_tensor_combinations_train_like_optax(model, kind, mesh, zero, opt_name):
    check(model, kind, mesh, zero, opt_name)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tied-gpt2", "tied-llama"])
def test_a_rerouted_program_with_tied_weights_and_a_clip_trains_like_optax(model):
    """Failure variants step every stage after the iteration (stagger_reroutes=False),
    so the tied sum and the whole model's norm are there before any update."""
    mesh = (2, 2, 2) if model == "tied-llama" else (2, 2, 1)
    check(model, "zb-h1", mesh, zero=False, opt_name="sgd", failed=((1, 0),))


def test_the_clip_acts_in_these_runs():
    """The threshold is below the gradient norm: the clipped run differs from the
    unclipped one (else the clip tests would not test the norm)."""
    clipped = optax_run("tied-gpt2", "sgd", True)[0]
    plain = optax_run("tied-gpt2", "sgd", False)[0]
    assert abs(clipped[-1] - plain[-1]) > 1e-3 * abs(plain[-1])


def test_zero_with_async_1f1b_is_refused_by_name():
    module, *_ = problem("mlp")
    with pytest.raises(pp.OptionError, match=r"zero=True with schedule='async-1f1b'.*zero=False"):
        pp.pipeline(
            module,
            stages=2,
            microbatches=2,
            schedule="async-1f1b",
            mesh=pp.make_mesh(data=2, stage=2),
            optimizer=optax.sgd(0.1),
            zero=True,
        )


def test_zero_with_the_optimizer_inside_the_loop_is_refused_by_name():
    """lower() of a staggered table with zero=True: refused while building the
    program (jax.jit compiles lazily, at the first call, so nothing has compiled)."""
    sched = stagger(make_schedule("1f1b", 2, 4, replicas=2))
    fns, params = tiny_model(2)
    x, y = batch(2 * 4 * 2, seed=0)
    options = LoweringOptions(optimizer=optax.sgd(0.1), zero=True)
    with pytest.raises(pp.OptionError, match=r"zero=True with the optimizer inside the tick loop"):
        lower(sched, fns, xent, mesh_of(2, 2), params, x, y, options)
