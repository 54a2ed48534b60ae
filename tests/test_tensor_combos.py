"""Tensor parallelism on the meshes and schedules beyond 1f1b on (D, P, T):
one stage (1x1xT), a tensor group of four (1x2x4, the tiny Llama) and the
chunked kinds. Each trains three SGD-momentum steps like plain
jax.value_and_grad + optax, or is refused with a PjitPipeError. The split
backward's W contracts the operands F stored, weights split or not."""

from __future__ import annotations

import collections
import dataclasses

import flax.linen as nn
import jax
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.frontend.cutter.tensor_split import unbox
from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss
from pjit_pipe.models.llama import Llama, LlamaConfig
from tests.numerics import rel_err
from tests.tiers import EXHAUSTIVE

GPT_MODEL = GPT(dataclasses.replace(GPTConfig.tiny(), megatron=True))
# Four query and four key/value heads: a tensor group of four holds whole heads.
LLAMA_MHA = Llama(LlamaConfig.tiny(n_kv_heads=4, n_layers=2))
# Two key/value heads over four devices: each device would hold half a head.
LLAMA_GQA = Llama(LlamaConfig.tiny(n_kv_heads=2, n_layers=2))
STEPS = 3


def batch(vocab: int, seq_len: int, n: int = 8):
    tokens = jax.random.randint(jax.random.key(0), (n, seq_len + 1), 0, vocab)
    return tokens[:, :-1], tokens[:, 1:]


def trains_like_optax(model, vocab: int, seq_len: int, mesh, **options) -> None:
    """Three pipelined SGD-momentum steps give optax's losses and parameters."""
    x, y = batch(vocab, seq_len)
    boxed = model.init(jax.random.key(1), x)
    opt = optax.sgd(0.1, momentum=0.9)
    pm = pp.pipeline(
        model, stages=mesh.shape["stage"], microbatches=4, mesh=mesh, optimizer=opt, **options
    )
    step = pm.train_step(lm_loss)
    state = step.init(boxed, (x, y))
    params = nn.meta.unbox(boxed)
    opt_state = opt.init(params)
    for _ in range(STEPS):
        state, loss = step(state, (x, y))
        want, grads = jax.value_and_grad(lambda p: lm_loss(model.apply(p, x), y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    assert rel_err(nn.meta.unbox(state.params), params) <= 1e-5


# tensor=2 on one stage, under every kind: test_combination_matrix.py's 1x1x2 rows.
@pytest.mark.parametrize("tensor", [pytest.param(2, marks=EXHAUSTIVE), 4])
def test_one_stage_split_over_tensor_trains_like_optax(tensor):
    c = GPT_MODEL.config
    trains_like_optax(GPT_MODEL, c.vocab, c.seq_len, pp.make_mesh(1, 1, tensor))


def test_llama_on_1x2x4_trains_like_optax():
    c = LLAMA_MHA.config
    trains_like_optax(LLAMA_MHA, c.vocab, c.seq_len, pp.make_mesh(1, 2, 4))


def test_llama_halving_its_heads_is_refused_not_deadlocked():
    c = LLAMA_GQA.config
    x, y = batch(c.vocab, c.seq_len)
    boxed = LLAMA_GQA.init(jax.random.key(1), x)
    pm = pp.pipeline(LLAMA_GQA, stages=2, microbatches=4, mesh=pp.make_mesh(1, 2, 4))
    with pytest.raises(pp.SplitError, match="whole attention heads"):
        pm.value_and_grad(lm_loss)(boxed, x, y)


# test_combination_matrix.py runs both kinds with the Llama on 1x2x2.
@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-v"])
@pytest.mark.slow
@pytest.mark.exhaustive
def test_chunked_kinds_split_over_tensor_train_like_optax(kind):
    # The Llama's head is split over 'tensor' and held by one chunk only.
    model = Llama(LlamaConfig.tiny(n_layers=4))
    c = model.config
    trains_like_optax(model, c.vocab, c.seq_len, pp.make_mesh(1, 2, 2), schedule=kind, chunks=2)


def dots_by_scope(jaxpr) -> collections.Counter:
    """The `dot_general` equations of a jaxpr and its sub-jaxprs, by name scope."""
    found: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found[str(eqn.source_info.name_stack)] += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += dots_by_scope(inner)
    return found


def test_w_contracts_stored_operands_with_weights_split_over_tensor():
    """zb-h1's W of the second stage, its Megatron weights split over 'tensor', holds
    one contraction per weight matmul: it reads the data operands F stored and the
    cotangents B stored, and runs no pullback (whose input-gradient chain would add
    the attention einsums' and every layer's input contractions). The step equals
    jax.value_and_grad: no stored row is resharded inside a stage's branch."""
    c = GPT_MODEL.config
    x, y = batch(c.vocab, c.seq_len)
    boxed = GPT_MODEL.init(jax.random.key(1), x)
    mesh = pp.make_mesh(1, 2, 2)
    pm = pp.pipeline(GPT_MODEL, stages=2, microbatches=4, schedule="zb-h1", mesh=mesh)
    plain, box = unbox(boxed)
    cut, step = pm.program(plain, x, y, lm_loss, boxed=box)
    paths = jax.tree_util.tree_leaves_with_path(cut.split(plain)[1])
    kernels = [p for p, _ in paths if getattr(p[-1], "key", None) == "kernel"]
    assert len(kernels) == 9  # two blocks (qkv, proj, two MLP denses) and the head
    dots = dots_by_scope(jax.make_jaxpr(step._value_and_grad)(*step._examples).jaxpr)
    assert dots["W stage 1"] == len(kernels)
    loss, grads = pm.value_and_grad(lm_loss)(boxed, x, y)
    want, want_grads = jax.value_and_grad(lambda p: lm_loss(GPT_MODEL.apply(p, x), y))(plain)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    assert rel_err(nn.meta.unbox(grads), want_grads) <= 1e-5
