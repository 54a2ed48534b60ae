"""A Llama-style decoder: RMSNorm, rotary attention with grouped-query heads,
SwiGLU MLP, an optional tied head, and its blocks in one `nn.scan` stack.

The blocks run as `nn.scan(nn.remat(LlamaBlock))` over stacked parameters
(MaxText's layout), so the model compiles one block however deep it is and
keeps only each block's input for the backward pass; pjit_pipe cuts the stack
between iterations (each stage takes rows of the stacked weights).

Tensor parallelism, Megatron's way, is written on the weights with
`nn.with_partitioning` over the mesh axis `tensor`: q, k, v and the MLP's gate
and up projections split their output dimension (column-parallel), the
attention output and the MLP's down projection split their input dimension
(row-parallel), so each block needs one reduction after attention and one
after the MLP. The token embedding and the untied head split the vocabulary
(Megatron's vocab-parallel embedding); RMSNorm scales stay replicated. The
stacked layer axis of the scanned weights is not split (partition name None).
`tensor_parallel=False` builds the same model with plain, unannotated weights,
for meshes that have no `tensor` axis.

Mixed precision is Flax's: `dtype` is the compute dtype of every module and
the parameters stay float32 (`param_dtype`), so with `dtype=jnp.bfloat16` the
activations (and what crosses a pipeline cut) are bf16 while gradients come
back float32. RMSNorm, the rotary angles and the softmax compute in float32.

Attention over a sequence longer than `attention_chunk` runs one block of
queries at a time, each block under its own checkpoint (Rabe and Staats,
"Self-attention does not need O(n^2) memory", 2021): a block's softmax is over
every key, so the values are those of one whole-sequence softmax, but a
block's backward recomputes its scores, so no more than one block's
[heads, chunk, T] scores and probabilities are live. At Llama-3-70B's 64
heads and 4096 tokens the whole matrices are 12 GB of a block's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pjit_pipe.models.gpt import lm_loss

Init = Callable[..., Any]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the decoder. `tiny` is the test size, `gpu` a few hundred million
    parameters (about 340M, untied) for one accelerator, `llama3_8b` and
    `llama3_70b` the published Llama-3 shapes (for memory reports from
    `jax.eval_shape`: the weights need not exist)."""

    vocab: int = 96
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 4
    d_ff: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    dtype: Any = jnp.float32
    remat: bool = True
    tensor_parallel: bool = True
    attention_chunk: int = 512  # queries per attention block (module docstring)

    @classmethod
    def tiny(cls, vocab: int = 96, **changes: Any) -> LlamaConfig:
        return cls(vocab=vocab, **changes)

    @classmethod
    def gpu(cls, **changes: Any) -> LlamaConfig:
        sizes = dict(
            vocab=32_000, seq_len=1024, d_model=1024, n_heads=16, n_kv_heads=4, n_layers=24
        )
        return cls(**{**sizes, "d_ff": 2816, **changes})

    @classmethod
    def llama3_8b(cls, **changes: Any) -> LlamaConfig:
        """Llama-3-8B's shapes (8.0B parameters untied), computing in bfloat16."""
        sizes = dict(
            vocab=128_256,
            seq_len=8192,
            d_model=4096,
            n_heads=32,
            n_kv_heads=8,
            n_layers=32,
            d_ff=14_336,
            rope_theta=500_000.0,
            dtype=jnp.bfloat16,
        )
        return cls(**{**sizes, **changes})

    @classmethod
    def llama3_70b(cls, **changes: Any) -> LlamaConfig:
        """Llama-3-70B's shapes (70.6B parameters untied), computing in bfloat16."""
        sizes = dict(
            vocab=128_256,
            seq_len=8192,
            d_model=8192,
            n_heads=64,
            n_kv_heads=8,
            n_layers=80,
            d_ff=28_672,
            rope_theta=500_000.0,
            dtype=jnp.bfloat16,
        )
        return cls(**{**sizes, **changes})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _split(config: LlamaConfig, init: Init, names: tuple[str | None, ...]) -> Init:
    """`init` annotated with how its weight splits over the mesh (when tensor parallel)."""
    return nn.with_partitioning(init, names) if config.tensor_parallel else init


def _dense(
    config: LlamaConfig, features: int, names: tuple[str | None, ...], name: str
) -> nn.Dense:
    """A bias-free projection in the compute dtype, its kernel split as `names` say."""
    init = _split(config, nn.initializers.lecun_normal(), names)
    return nn.Dense(features, use_bias=False, dtype=config.dtype, kernel_init=init, name=name)


COLUMN = (None, "tensor")  # [in, out] kernels split on the output dimension
ROW = ("tensor", None)  # [in, out] kernels split on the input dimension


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in float32 and returned in `dtype`."""

    eps: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * scale).astype(self.dtype)


def rotate(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of x [..., T, heads, head_dim]: the pair
    (x[i], x[i + head_dim/2]) at position t turns by t * theta^(-2i/head_dim)."""
    t, half = x.shape[-3], x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs  # [T, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [T, 1, half]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, offset: jax.Array | int = 0
) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v over the keys at or before each query's position.

    q [..., Tq, kv, group, d] holds the queries of positions offset..offset+Tq-1,
    k and v [..., T, kv, d] every position's keys and values; query head (j, g)
    reads key/value head j (grouped-query attention). Scores and softmax in
    float32, the result in q's dtype."""
    t_q, t, head = q.shape[-4], k.shape[-3], q.shape[-1]
    scores = jnp.einsum("...qkgd,...skd->...kgqs", q, k).astype(jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(head))
    causal = offset + jnp.arange(t_q)[:, None] >= jnp.arange(t)[None, :]  # [Tq, T]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("...kgqs,...skd->...qkgd", weights, v)


def chunked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
    """`causal_attention` one block of `chunk` queries at a time, each block
    checkpointed (module docstring), the last block shorter where `chunk` does
    not divide the sequence; the whole sequence at once where it is no longer
    than `chunk`."""
    *lead, t, kv, group, head = q.shape
    if t <= chunk:
        return causal_attention(q, k, v)
    block = jax.checkpoint(lambda qb, start: causal_attention(qb, k, v, start))
    whole = t - t % chunk  # queries in full blocks
    blocks = q[..., :whole, :, :, :].reshape(*lead, whole // chunk, chunk, kv, group, head)
    out = jax.lax.map(
        lambda args: block(*args), (jnp.moveaxis(blocks, len(lead), 0), jnp.arange(0, whole, chunk))
    )
    out = jnp.moveaxis(out, 0, len(lead)).reshape(*lead, whole, kv, group, head)
    if whole == t:
        return out
    rest = block(q[..., whole:, :, :, :], whole)
    return jnp.concatenate([out, rest], axis=-4)


class Attention(nn.Module):
    """Causal self-attention with n_kv_heads key/value heads, each shared by
    n_heads / n_kv_heads query heads (grouped-query attention)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        *lead, t, _ = x.shape
        head, kv, group = c.head_dim, c.n_kv_heads, c.n_heads // c.n_kv_heads
        q = _dense(c, c.n_heads * head, COLUMN, "q")(x).reshape(*lead, t, c.n_heads, head)
        k = _dense(c, kv * head, COLUMN, "k")(x).reshape(*lead, t, kv, head)
        v = _dense(c, kv * head, COLUMN, "v")(x).reshape(*lead, t, kv, head)
        q = rotate(q, c.rope_theta).reshape(*lead, t, kv, group, head)  # head h: kv h // group
        k = rotate(k, c.rope_theta)
        out = chunked_causal_attention(q, k, v, c.attention_chunk)
        return _dense(c, c.d_model, ROW, "o")(out.reshape(*lead, t, c.n_heads * head))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = nn.silu(_dense(c, c.d_ff, COLUMN, "gate")(x)) * _dense(c, c.d_ff, COLUMN, "up")(x)
        return _dense(c, c.d_model, ROW, "down")(h)


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); an nn.scan body
    (carry in, carry out, no per-layer output)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        c = self.config
        x = x + Attention(c, name="attn")(RMSNorm(c.norm_eps, c.dtype, name="attn_norm")(x))
        x = x + SwiGLU(c, name="mlp")(RMSNorm(c.norm_eps, c.dtype, name="mlp_norm")(x))
        return x, None


class Llama(nn.Module):
    """tokens [..., T] (int) -> logits [..., T, vocab] (in the compute dtype)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        if c.d_model % c.n_heads or c.n_heads % c.n_kv_heads or c.head_dim % 2:
            raise ValueError(
                f"config: n_heads ({c.n_heads}) must divide d_model ({c.d_model}) into an "
                f"even head size and be a multiple of n_kv_heads ({c.n_kv_heads})"
            )
        if tokens.shape[-1] > c.seq_len:
            raise ValueError(
                f"tokens: sequence length {tokens.shape[-1]} exceeds config.seq_len {c.seq_len}"
            )
        embed_init = _split(c, nn.initializers.normal(0.02), ROW)  # [vocab, d]: vocab split
        embed = nn.Embed(c.vocab, c.d_model, dtype=c.dtype, embedding_init=embed_init, name="embed")
        block = nn.remat(LlamaBlock, prevent_cse=False) if c.remat else LlamaBlock
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=c.n_layers,
            metadata_params={nn.PARTITION_NAME: None},  # the layer axis is not split
        )
        x, _ = stack(c, name="layers")(embed(tokens))
        x = RMSNorm(c.norm_eps, c.dtype, name="norm")(x)
        if c.tie_embeddings:
            return embed.attend(x)
        head_init = _split(c, nn.initializers.lecun_normal(), COLUMN)  # [d, vocab]: vocab split
        return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, kernel_init=head_init, name="head")(
            x
        )


__all__ = [
    "Attention",
    "Llama",
    "LlamaBlock",
    "LlamaConfig",
    "RMSNorm",
    "SwiGLU",
    "causal_attention",
    "chunked_causal_attention",
    "lm_loss",
]
