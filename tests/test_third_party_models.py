"""Models nobody on this project wrote, pipelined as their libraries ship them.

Hugging Face transformers 4.x's Flax classes (GPT-2 with its head applying the
tied `wte` kernel, Llama, BERT's masked LM with token types and padding) keep
their blocks two or three modules down (`transformer.h.N`, `model.layers.N`,
`bert.encoder.layer.N`); recurrentgemma's Griffin returns per-block caches
beside its logits and decodes with its tied embedder. Each is built from a
tiny config with random initialization, and compared with plain JAX:
`jax.value_and_grad` of the unpipelined model on the same batch, optax's adamw
on the whole tree, the same keys per microbatch for dropout. Each promise is
checked once per model rather than in a full product (each case compiles a
pipeline): the schedule kinds (1f1b, zb-h1, interleaved-1f1b) and both stage
counts are spread over the models, and the failure variant, training and
dropout run on one model each. The libraries come with `pip install -e
'.[models]'` (and recurrentgemma, see the Makefile); a test skips where its
library is missing. gemma is not installed by `make test` (it brings
TensorFlow); its test runs where it is installed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.errors import CutError
from tests.numerics import rel_err

pytestmark = pytest.mark.slow

VOCAB, LENGTH, BATCH = 64, 8, 8


def _hf(module: str):
    """A transformers 4.x Flax modeling module (5.x has none)."""
    pytest.importorskip("transformers")
    return pytest.importorskip(
        f"transformers.models.{module}",
        reason="transformers 5 has no Flax models: pip install -e '.[models]' for 4.x",
    )


def _tokens(seed: int = 1, batch: int = BATCH) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, LENGTH + 1), 0, VOCAB)


def _padding(batch: int = BATCH) -> jax.Array:
    """Row r keeps its first LENGTH - r % 3 tokens (padding on the right)."""
    keep = LENGTH - jnp.arange(batch) % 3
    return (jnp.arange(LENGTH)[None, :] < keep[:, None]).astype(jnp.int32)


def _positions(batch: int = BATCH) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(LENGTH), (batch, LENGTH))


def causal_lm_loss(out, y):
    """Mean next-token cross-entropy over the positions whose target is >= 0."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    keep = y >= 0
    xent = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(keep, y, 0))
    return jnp.sum(xent * keep), jnp.sum(keep).astype(jnp.float32)


def _reference_loss(model, loss_fn, x, y, rngs=None, count=1):
    """The unpipelined model's loss as the pipeline defines it: sum(loss_sum) /
    sum(weight) over the batch; with rngs, microbatch i of `count` applied with
    key fold_in(key, i), as each pipelined microbatch is."""
    rows = BATCH // count

    def loss(params):
        total, weight = 0.0, 0.0
        for i in range(count if rngs is not None else 1):
            part = slice(i * rows, (i + 1) * rows) if rngs is not None else slice(None)
            xi = jax.tree.map(lambda v, part=part: v[part], x)
            extra = {} if rngs is None else {"rngs": {"dropout": jax.random.fold_in(rngs, i)}}
            s, w = loss_fn(model.apply(params, **xi, **extra), y[part])
            total, weight = total + s, weight + w
        return total / weight

    return loss


def _matches_jax(
    model, x, y, *, stages, kind, data=1, chunks=None, rngs=None, failed=(), microbatches=2
):
    """The pipelined loss and gradients equal jax.value_and_grad's; returns the
    pipeline and parameters for more checks."""
    mesh = pp.make_mesh(data=data, stage=stages)
    pm = pp.pipeline(
        model, stages=stages, microbatches=microbatches, schedule=kind, mesh=mesh, chunks=chunks
    )
    params = jax.jit(lambda k: model.init(k, **x))(jax.random.key(0))
    run = pm.with_failures(list(failed)) if failed else pm
    loss, grads = run.value_and_grad(causal_lm_loss)(params, x, y, rngs=rngs)
    reference = _reference_loss(model, causal_lm_loss, x, y, rngs, count=microbatches * data)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert _grads_err(grads, ref_grads) < 1e-5
    return pm, params


# An attention key's bias shifts every score of a query alike, which softmax
# ignores: its gradient is zero in exact arithmetic, and rounding noise in both
# runs. It is compared against the largest gradient instead of its own size.
ZERO_IN_EXACT_ARITHMETIC = "['key']['bias']"


def _grads_err(grads, ref_grads) -> float:
    """rel_err over the leaves, the zero-in-exact-arithmetic ones taken relative to
    the largest gradient of the model."""
    scale = max(float(np.max(np.abs(np.asarray(g)))) for g in jax.tree.leaves(ref_grads))
    worst = 0.0
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, got), want in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        if ZERO_IN_EXACT_ARITHMETIC in jax.tree_util.keystr(path):
            worst = max(worst, float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) / scale)
        else:
            worst = max(worst, rel_err(got, want))
    return worst


def _lm_batch(padding: bool = True):
    tokens = _tokens()
    mask = _padding() if padding else jnp.ones((BATCH, LENGTH), jnp.int32)
    x = dict(input_ids=tokens[:, :-1], attention_mask=mask, position_ids=_positions())
    y = jnp.where(mask > 0, tokens[:, 1:], -1)
    return x, y


# ---- Hugging Face GPT-2: the head applies the tied wte kernel ----


def _gpt2(layers: int = 4):
    transformers = pytest.importorskip("transformers")
    hf = _hf("gpt2.modeling_flax_gpt2")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=layers, n_head=2
    )
    return hf.FlaxGPT2LMHeadModule(config)


def test_hf_gpt2_is_cut_between_its_nested_blocks_with_its_head_tied():
    model = _gpt2()
    x, y = _lm_batch()
    pm, params = _matches_jax(model, x, y, stages=4, kind="zb-h1", data=2)
    cut = pm.cut(params, x)
    assert [cut.events[b].name for b in cut.bounds[1:]] == [
        "transformer.h.1",
        "transformer.h.2",
        "transformer.h.3",
    ]
    assert cut.shared == {"transformer/wte": (0, 3)}
    assert "stage 2 (cut before transformer.h.2): transformer.h.2" in cut.describe()


def test_hf_gpt2_through_a_failure_matches_jax():
    _matches_jax(_gpt2(), *_lm_batch(), stages=2, kind="1f1b", data=2, failed=[(0, 1)])


# ---- Hugging Face Llama: model.layers.N, untied head ----


def _llama(layers: int = 4):
    transformers = pytest.importorskip("transformers")
    hf = _hf("llama.modeling_flax_llama")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return hf.FlaxLlamaForCausalLMModule(config)


def test_hf_llama_interleaved_matches_jax():
    """Two stages of two chunks: four virtual stages, cut at model.layers.N."""
    _matches_jax(_llama(), *_lm_batch(), stages=2, kind="interleaved-1f1b", chunks=2)


def test_hf_llama_adamw_steps_match_optax_at_named_split_points():
    model = _llama()
    x, y = _lm_batch()
    # adam would turn the rounding noise of a zero-gradient leaf into full-size steps in
    # either run; a larger eps keeps such steps small.
    opt = optax.adamw(1e-2, eps=1e-3)
    pm = pp.pipeline(
        model,
        stages=2,
        microbatches=2,
        schedule="1f1b",
        mesh=pp.make_mesh(data=1, stage=2),
        optimizer=opt,
        split_points=["model.layers.3"],
    )
    params = jax.jit(lambda k: model.init(k, **x))(jax.random.key(0))
    assert pm.cut(params, x).stage_names(1) == ["model.layers.3", "model.norm", "lm_head"]
    step = pm.train_step(causal_lm_loss)
    state = step.init(params, (x, y))
    reference = jax.value_and_grad(_reference_loss(model, causal_lm_loss, x, y))

    @jax.jit
    def ref_step(p, s):
        loss, grads = reference(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    ref_params, ref_state = params, opt.init(params)
    for _ in range(2):
        state, loss = step(state, (x, y))
        ref_params, ref_state, ref_loss = ref_step(ref_params, ref_state)
        assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(state.params, ref_params) < 1e-5


def test_split_points_are_checked_by_name():
    model = _llama()
    x, _ = _lm_batch()
    params = jax.eval_shape(lambda k: model.init(k, **x), jax.random.key(0))
    pm = pp.pipeline(model, stages=2, microbatches=2, split_points=["model.layer.2"])
    with pytest.raises(CutError, match=r"unknown cut point 'model.layer.2'.*'model.layers.2'"):
        pm.cut(params, x)


# ---- Hugging Face BERT: masked LM, token types, padding, dropout ----


def _bert(dropout: bool, layers: int = 4):
    transformers = pytest.importorskip("transformers")
    hf = _hf("bert.modeling_flax_bert")
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=16,
    )

    class TrainingBert(hf.FlaxBertForMaskedLMModule):
        """The shipped module with its dropout on (`deterministic` is a Python
        flag, so it is fixed here rather than passed in the batch)."""

        def __call__(self, input_ids, attention_mask, token_type_ids, position_ids):
            return super().__call__(
                input_ids, attention_mask, token_type_ids, position_ids, None, deterministic=False
            )

    return TrainingBert(config) if dropout else hf.FlaxBertForMaskedLMModule(config)


def _mlm_batch(shipped_call: bool = False):
    """Masked tokens, token types, padding; `shipped_call`: with the head_mask
    argument the shipped module's __call__ requires (None)."""
    tokens = _tokens()[:, :-1]
    mask = _padding()
    masked = (jax.random.uniform(jax.random.key(3), tokens.shape) < 0.3) & (mask > 0)
    x = dict(
        input_ids=jnp.where(masked, 0, tokens),
        attention_mask=mask,
        token_type_ids=(jnp.arange(LENGTH) >= LENGTH // 2).astype(jnp.int32)[None].repeat(BATCH, 0),
        position_ids=_positions(),
    )
    if shipped_call:
        x["head_mask"] = None
    return x, jnp.where(masked, tokens, -1)


def test_hf_bert_masked_lm_with_dropout_matches_jax():
    model = _bert(dropout=True)
    x, y = _mlm_batch()
    pm, params = _matches_jax(model, x, y, stages=4, kind="1f1b", rngs=jax.random.key(7))
    assert pm.cut(params, x).shared == {"bert/embeddings": (0, 3)}


def test_hf_bert_with_gradient_checkpointing_is_cut_between_its_remat_layers():
    """gradient_checkpointing=True wraps each layer in remat, three modules down:
    the cut enters each layer outside its transform (the stages composed here)."""
    from tests.test_frontend import compose

    transformers = pytest.importorskip("transformers")
    hf = _hf("bert.modeling_flax_bert")
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    model = hf.FlaxBertForMaskedLMModule(config, gradient_checkpointing=True)
    x, _ = _mlm_batch(shipped_call=True)
    params = jax.jit(lambda k: model.init(k, **x))(jax.random.key(0))
    cut = pp.frontend.cut_module(model, params, x, 4)
    starts = [cut.events[b] for b in cut.bounds[1:]]
    assert [e.name for e in starts] == [f"bert.encoder.layer.{i}" for i in (1, 2, 3)]
    assert all(e.transform is not None for e in starts)
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    assert rel_err(out, model.apply(params, **x)) < 1e-5


# ---- recurrentgemma's Griffin: per-block caches beside the logits ----


def _griffin(layers: int = 4):
    common = pytest.importorskip("recurrentgemma.common")
    griffin = pytest.importorskip("recurrentgemma.jax")
    T = common.TemporalBlockType
    config = common.GriffinConfig(
        vocab_size=VOCAB,
        width=32,
        mlp_expanded_width=64,
        num_heads=2,
        block_types=((T.RECURRENT, T.RECURRENT, T.ATTENTION, T.RECURRENT) * layers)[:layers],
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=8,
        logits_soft_cap=30.0,
        lru_width=32,
        scan_type=common.ScanType.LINEAR_NATIVE,
    )
    return griffin.Griffin(config)


def _griffin_batch():
    tokens = _tokens()
    x = dict(tokens=tokens[:, :-1], segment_pos=_positions())
    return x, tokens[:, 1:]


def test_griffin_with_its_caches_matches_jax_and_a_loss_that_reads_them_is_refused():
    model = _griffin()
    x, y = _griffin_batch()
    pm, params = _matches_jax(model, x, y, stages=4, kind="zb-h1")
    cut = pm.cut(params, x)
    assert cut.shared == {"embedder": (0, 3)}
    assert {o.producers for o in cut.stale_outputs} == {("blocks.0",), ("blocks.1",), ("blocks.2",)}
    # The forward pass gives the last stage's own block's cache, and the others as NaN.
    logits, cache = pm.forward(params, x)
    ref_logits, ref_cache = model.apply(params, **x)
    assert rel_err(logits, ref_logits) < 1e-5
    assert rel_err(cache["blocks.3"], ref_cache["blocks.3"]) < 1e-5
    assert all(bool(jnp.all(jnp.isnan(cache[f"blocks.{i}"].rg_lru_state))) for i in (0, 1))
    reads_cache = lambda out, y: causal_lm_loss(out, y)[0] + out[1]["blocks.0"].rg_lru_state.sum()  # noqa: E731
    with pytest.raises(CutError, match=r"reads outputs of Griffin .*\['blocks.0'\]\.rg_lru_state"):
        pm.value_and_grad(reads_cache)(params, x, y)


@pytest.mark.parametrize("kind", ["interleaved-1f1b"])
def test_griffin_interleaved_matches_jax(kind):
    _matches_jax(_griffin(), *_griffin_batch(), stages=2, kind=kind, chunks=2, data=2)


# ---- gemma: the root's __call__ under nn.jit (not installed by make test) ----


def test_gemma_under_its_root_jit_matches_jax():
    """gemma's Transformer as shipped: nn.jit on its __call__ (seen through),
    positions and a (B, L, L) mask as inputs, an Output dataclass as output."""
    gm = pytest.importorskip("gemma.gm", reason="gemma: pip install gemma (TensorFlow, kauldron)")
    from gemma.gm.nn import _config, _modules

    A = _modules.AttentionType
    config = _config.TransformerConfig(
        num_embed=VOCAB,
        embed_dim=32,
        hidden_dim=64,
        num_heads=2,
        head_dim=16,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attention_types=(A.GLOBAL, A.LOCAL_SLIDING) * 2,
        sliding_window_size=4,
    )
    model = gm.nn.Transformer(config=config, dtype=jnp.float32, tokens="batch.tokens")
    tokens = _tokens()
    causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
    x = dict(
        tokens=tokens[:, :-1],
        positions=_positions(),
        attention_mask=jnp.broadcast_to(causal, (BATCH, LENGTH, LENGTH)),
    )
    pm, params = _matches_jax(model, x, tokens[:, 1:], stages=4, kind="zb-h1", data=2)
    assert pm.cut(params, x).shared == {"embedder": (0, 3)}


# ---- the whole product, on request (pytest -m exhaustive) ----

MODELS = {
    "gpt2": lambda layers: (_gpt2(layers), _lm_batch()),
    "llama": lambda layers: (_llama(layers), _lm_batch()),
    "bert": lambda layers: (_bert(False, layers), _mlm_batch(shipped_call=True)),
    "griffin": lambda layers: (_griffin(layers), _griffin_batch()),
}


@pytest.mark.exhaustive
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "interleaved-1f1b"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_kind_and_stage_count_matches_jax(name, kind, stages):
    """Eight blocks, so that interleaved-1f1b at P=4 has its eight virtual stages
    (and as many microbatches as stages, which it needs)."""
    model, (x, y) = MODELS[name](8)
    interleaved = kind == "interleaved-1f1b"
    _matches_jax(
        model,
        x,
        y,
        stages=stages,
        kind=kind,
        chunks=2 if interleaved else None,
        data=2,
        microbatches=stages if interleaved else 2,
    )
