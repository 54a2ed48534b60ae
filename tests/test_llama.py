"""The Llama-style reference model: its semantics (grouped-query heads share
k/v, rotary angles depend on position, the tied head is the embedding), its
tensor-parallel annotations, and the pipelined model against
jax.value_and_grad of the unpipelined one."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjit_pipe as pp
from pjit_pipe.models.llama import Llama, LlamaConfig, chunked_causal_attention, lm_loss, rotate
from tests.numerics import rel_err

TOKENS = jax.random.randint(jax.random.key(1), (8, 32), 0, 96)


def _params(config: LlamaConfig, tokens=TOKENS):
    return jax.jit(Llama(config).init)(jax.random.key(0), tokens)


def test_shapes_and_gpu_size():
    c = LlamaConfig.tiny(tensor_parallel=False)
    params = _params(c)["params"]
    layer, hd = params["layers"], c.head_dim
    assert layer["attn"]["q"]["kernel"].shape == (c.n_layers, c.d_model, c.n_heads * hd)
    assert layer["attn"]["k"]["kernel"].shape == (c.n_layers, c.d_model, c.n_kv_heads * hd)
    assert layer["mlp"]["gate"]["kernel"].shape == (c.n_layers, c.d_model, c.d_ff)
    assert Llama(c).apply({"params": params}, TOKENS).shape == (8, 32, c.vocab)
    # The GPU size: the parameter count in closed form, a few hundred million.
    g = LlamaConfig.gpu()
    shapes = jax.eval_shape(Llama(g).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    count = sum(a.size for a in jax.tree.leaves(nn.unbox(shapes)))
    hd = g.head_dim
    attention = g.d_model * hd * (2 * g.n_heads + 2 * g.n_kv_heads)
    block = attention + 3 * g.d_model * g.d_ff + 2 * g.d_model
    assert count == 2 * g.vocab * g.d_model + g.n_layers * block + g.d_model
    assert 2e8 < count < 5e8


def test_grouped_query_heads_share_their_key_value_head():
    """GQA with 2 kv heads equals multi-head attention (4 kv heads) whose k/v
    weights repeat each kv head for the query heads of its group."""
    gqa = LlamaConfig.tiny(tensor_parallel=False)
    mha = LlamaConfig.tiny(tensor_parallel=False, n_kv_heads=gqa.n_heads)
    params = _params(gqa)
    group, hd = gqa.n_heads // gqa.n_kv_heads, gqa.head_dim

    def repeat(kernel):  # [L, d, kv*hd] -> [L, d, heads*hd], head h reads kv head h // group
        layers, d, _ = kernel.shape
        split = kernel.reshape(layers, d, gqa.n_kv_heads, hd)
        return jnp.repeat(split, group, axis=2).reshape(layers, d, gqa.n_heads * hd)

    wide = jax.tree.map(lambda a: a, params)
    for name in ("k", "v"):
        kernel = params["params"]["layers"]["attn"][name]["kernel"]
        wide["params"]["layers"]["attn"][name]["kernel"] = repeat(kernel)
    out = Llama(gqa).apply(params, TOKENS)
    ref = Llama(mha).apply(wide, TOKENS)
    assert rel_err(out, ref) < 1e-5
    # and a kv head is not a query head's own: changing kv head 0 changes heads 0..group-1
    bumped = jax.tree.map(lambda a: a, params)
    v = params["params"]["layers"]["attn"]["v"]["kernel"]
    bumped["params"]["layers"]["attn"]["v"]["kernel"] = v.at[..., :hd].add(1.0)
    assert rel_err(Llama(gqa).apply(bumped, TOKENS), out) > 1e-3


def test_attention_in_query_blocks_is_the_whole_causal_softmax_and_keeps_no_score_matrix():
    """Blocks of 8 or 12 queries (of 32) give jax.nn.dot_product_attention's causal
    GQA values and gradients, and the backward stores no [T, T] scores (each block's are
    recomputed), where the whole-sequence attention stores them."""
    t, kv, group, head = 32, 2, 2, 8
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (2, t, kv, group, head))
    k, v = (jax.random.normal(key, (2, t, kv, head)) for key in keys[1:3])
    probe = jax.random.normal(keys[3], q.shape)

    def ours(chunk):
        return lambda q, k, v: jnp.sum(chunked_causal_attention(q, k, v, chunk) * probe)

    def reference(q, k, v):
        out = jax.nn.dot_product_attention(q.reshape(2, t, kv * group, head), k, v, is_causal=True)
        return jnp.sum(out.reshape(q.shape) * probe)

    want = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
    for chunk in (8, 12):  # 12: two blocks of 12 and a last one of 8
        got = jax.value_and_grad(ours(chunk), argnums=(0, 1, 2))(q, k, v)
        assert rel_err(got[0], want[0]) < 1e-5
        for g, w in zip(got[1], want[1], strict=True):
            assert rel_err(g, w) < 1e-5

    def largest_residual(fn):
        _, pull = jax.vjp(fn, q, k, v)
        return max(a.size for a in jax.tree.leaves(pull) if hasattr(a, "size"))

    scores = 2 * kv * group * t * t
    assert largest_residual(ours(t)) >= scores  # the whole sequence: its scores are stored
    assert largest_residual(ours(8)) < scores // 2


def test_rotary_turns_each_pair_by_its_position():
    # head size 2: one pair with frequency theta^0 = 1, so position t turns (1, 0) by t radians
    x = jnp.tile(jnp.array([1.0, 0.0]), (6, 1, 1))  # [T=6, heads=1, 2]
    t = jnp.arange(6.0)
    expected = jnp.stack([jnp.cos(t), jnp.sin(t)], axis=-1)[:, None, :]
    assert rel_err(rotate(x, 10_000.0), expected) < 1e-6
    # head size 8: scores <rot(q)_m, rot(k)_n> depend on m - n, and only on it
    q, k = jax.random.normal(jax.random.key(2), (2, 8))
    rq = rotate(jnp.tile(q, (10, 1, 1)), 10_000.0)[:, 0]
    rk = rotate(jnp.tile(k, (10, 1, 1)), 10_000.0)[:, 0]
    scores = np.asarray(rq @ rk.T)
    for offset in range(-9, 10):
        diagonal = np.diagonal(scores, offset)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-5, atol=1e-5)
    assert abs(scores[0, 0] - scores[0, 1]) > 1e-3


def test_tied_head_is_the_embedding():
    c = LlamaConfig.tiny(tensor_parallel=False, tie_embeddings=True)
    params = _params(c)
    assert "head" not in params["params"]
    logits, seen = Llama(c).apply(
        params, TOKENS, capture_intermediates=lambda m, _: m.name == "norm"
    )
    (normed,) = seen["intermediates"]["norm"]["__call__"]
    embedding = params["params"]["embed"]["embedding"]
    assert rel_err(logits, normed @ embedding.T) < 1e-6


def test_megatron_annotations():
    """Column-parallel in-projections, row-parallel out-projections, vocab-split
    embedding and head; the same weights as the unannotated model."""
    boxed = _params(LlamaConfig.tiny())["params"]
    names = jax.tree.map(
        lambda a: getattr(a, "names", None), boxed, is_leaf=lambda a: isinstance(a, nn.Partitioned)
    )
    column, row = (None, None, "tensor"), (None, "tensor", None)
    for name in ("q", "k", "v"):
        assert names["layers"]["attn"][name]["kernel"] == column
    assert names["layers"]["mlp"]["gate"]["kernel"] == names["layers"]["mlp"]["up"]["kernel"]
    assert names["layers"]["mlp"]["up"]["kernel"] == column
    assert names["layers"]["attn"]["o"]["kernel"] == names["layers"]["mlp"]["down"]["kernel"] == row
    assert names["embed"]["embedding"] == ("tensor", None)
    assert names["head"]["kernel"] == (None, "tensor")
    assert names["norm"]["scale"] is None  # replicated
    plain = _params(LlamaConfig.tiny(tensor_parallel=False))["params"]
    assert jax.tree.all(jax.tree.map(np.array_equal, nn.unbox(boxed), plain))


def _pipelined_case(data: int, kind: str, tie: bool, attention_chunk: int = 512) -> None:
    """Loss and gradients of the tiny Llama cut into 4 stages (the scanned
    blocks split between them) equal jax.value_and_grad's."""
    config = LlamaConfig.tiny(
        tensor_parallel=False, tie_embeddings=tie, attention_chunk=attention_chunk
    )
    model = Llama(config)
    targets = jnp.roll(TOKENS, -1, axis=1)
    mesh = pp.make_mesh(data=data, stage=4)
    pm = pp.pipeline(model, stages=4, microbatches=2, schedule=kind, mesh=mesh)
    params = _params(model.config)
    loss, grads = pm.value_and_grad(lm_loss)(params, TOKENS, targets)
    reference = jax.value_and_grad(lambda p: lm_loss(model.apply(p, TOKENS), targets))
    ref_loss, ref_grads = jax.jit(reference)(params)
    assert any("layers[" in key for keys in pm.cut(params, TOKENS).keys for key in keys)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def test_llama_pipelined_1x4_1f1b_matches_jax():
    """With attention in blocks of 8 queries: a checkpointed loop inside each
    checkpointed, scanned block, as at Llama-3 sizes."""
    _pipelined_case(1, "1f1b", tie=False, attention_chunk=8)


# The opposite corner, with the tied head (a parameter of the first and the last
# stage). The tied Llama also trains in test_zero_combos.py, split over 'tensor'.
@pytest.mark.slow
@pytest.mark.exhaustive
def test_llama_pipelined_2x4_zb_h1_tied_matches_jax():
    _pipelined_case(2, "zb-h1", tie=True)


def test_llama_in_bf16_sends_bf16_activations():
    """Flax mixed precision: float32 parameters, bf16 compute, so what crosses a
    stage boundary (the lowering's message buffers) is bf16."""
    model = Llama(LlamaConfig.tiny(tensor_parallel=False, dtype=jnp.bfloat16))
    params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    pm = pp.pipeline(
        model, stages=4, microbatches=2, schedule="1f1b", mesh=pp.make_mesh(data=1, stage=4)
    )
    _, program = pm.program(params, TOKENS, jnp.roll(TOKENS, -1, axis=1), lm_loss)
    c = model.config
    assert program._low.msg_spec.sizes == {"bfloat16": 4 * c.seq_len * c.d_model}
