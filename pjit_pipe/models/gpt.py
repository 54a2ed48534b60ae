"""A GPT-style decoder: token and position embeddings, pre-norm blocks, LM head.

The blocks are a list of submodules called in a loop, so pjit_pipe can cut
between any two of them; the model itself knows nothing about pipelining.
With `megatron=True` the blocks' weights carry Megatron's tensor-parallel
annotations (`nn.with_partitioning` over the mesh axis 'tensor'): qkv and the
MLP's up-projection split on their output dimension (columns), the attention
output and the MLP's down-projection on their input dimension (rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the decoder. `tiny` is the test/demo size. `dtype` is the modules'
    compute dtype; parameters stay float32 (Flax mixed precision, docs/mixed_precision.md)."""

    vocab: int = 96
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 256
    megatron: bool = False  # tensor-parallel annotations (see the module docstring)
    dtype: Any = jnp.float32

    @classmethod
    def tiny(cls, vocab: int = 96) -> GPTConfig:
        return cls(vocab=vocab, seq_len=32, d_model=64, n_heads=4, n_layers=4, d_ff=256)


def _dense(
    features: int, split: str | None, name: str | None = None, dtype: Any = None
) -> nn.Dense:
    """nn.Dense computing in `dtype`, its kernel split over 'tensor' on the output
    ("column", with its bias) or input ("row") dimension, or not at all (None)."""
    if split is None:
        return nn.Dense(features, name=name, dtype=dtype)
    kernel = nn.initializers.lecun_normal()
    if split == "column":
        return nn.Dense(
            features,
            name=name,
            dtype=dtype,
            kernel_init=nn.with_partitioning(kernel, (None, "tensor")),
            bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ("tensor",)),
        )
    kernel_init = nn.with_partitioning(kernel, ("tensor", None))
    return nn.Dense(features, name=name, dtype=dtype, kernel_init=kernel_init)


class CausalSelfAttention(nn.Module):
    d_model: int
    n_heads: int
    megatron: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        *lead, t, d = x.shape
        head = d // self.n_heads
        column, row = ("column", "row") if self.megatron else (None, None)
        qkv = _dense(3 * d, column, "qkv", self.dtype)(x).reshape(*lead, t, 3, self.n_heads, head)
        q, k, v = (qkv[..., i, :, :] for i in range(3))
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / jnp.sqrt(head).astype(x.dtype)
        mask = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(scores, axis=-1), v)
        return _dense(d, row, "proj", self.dtype)(out.reshape(*lead, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    d_model: int
    n_heads: int
    d_ff: int
    megatron: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        column, row = ("column", "row") if self.megatron else (None, None)
        attention = CausalSelfAttention(self.d_model, self.n_heads, self.megatron, dt)
        x = x + attention(nn.LayerNorm(dtype=dt)(x))
        h = nn.gelu(_dense(self.d_ff, column, "Dense_0", dt)(nn.LayerNorm(dtype=dt)(x)))
        return x + _dense(self.d_model, row, "Dense_1", dt)(h)


class GPT(nn.Module):
    """tokens [..., T] (int) -> logits [..., T, vocab]."""

    config: GPTConfig

    def setup(self) -> None:
        c = self.config
        if c.d_model % c.n_heads:
            raise ValueError(f"d_model ({c.d_model}) must be divisible by n_heads ({c.n_heads})")
        self.wte = nn.Embed(c.vocab, c.d_model, dtype=c.dtype)
        self.wpe = nn.Embed(c.seq_len, c.d_model, dtype=c.dtype)
        self.blocks = [
            Block(c.d_model, c.n_heads, c.d_ff, c.megatron, c.dtype) for _ in range(c.n_layers)
        ]
        self.ln_f = nn.LayerNorm(dtype=c.dtype)
        self.head = nn.Dense(c.vocab, use_bias=False, dtype=c.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds config.seq_len {self.config.seq_len}")
        x = self.wte(tokens) + self.wpe(jnp.arange(t))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32 whatever the logits' dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets
    ).mean()
