"""A GPT-2-style LM with the Hugging Face call signature and tied embeddings.

`__call__(input_ids, attention_mask, position_ids)` as in HF transformers:
the padding mask goes to every block next to the hidden state, so a
(hidden, mask) pair crosses each pipeline cut, and the LM head is the token
embedding itself (`wte.attend`), a parameter shared by the first and the last
stage. `remat=True` wraps every block in `nn.remat`. HF's own Flax GPT-2 nests
its blocks two modules deep, where the cutter does not look; this model keeps
HF's computation with the blocks at the top level (see tests/test_models.py
for HF's own block in this layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GPT2Config:
    vocab: int = 64
    n_positions: int = 16
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 4
    remat: bool = False


class GPT2Block(nn.Module):
    """Pre-norm block; attention is causal and skips padded keys (mask 0)."""

    d_model: int
    n_heads: int

    @nn.compact
    def __call__(self, h: jax.Array, attention_mask: jax.Array) -> jax.Array:
        b, t, d = h.shape
        head = d // self.n_heads
        x = nn.LayerNorm(epsilon=1e-5, name="ln_1")(h)
        q, k, v = jnp.split(nn.Dense(3 * d, name="c_attn")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.n_heads, head) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head).astype(h.dtype)
        allowed = (
            jnp.tril(jnp.ones((t, t), bool))[None, None] & (attention_mask > 0)[:, None, None, :]
        )
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        h = h + nn.Dense(d, name="c_proj")(out.reshape(b, t, d))
        x = nn.LayerNorm(epsilon=1e-5, name="ln_2")(h)
        return h + nn.Dense(d, name="mlp_out")(nn.gelu(nn.Dense(4 * d, name="mlp_in")(x)))


class GPT2LM(nn.Module):
    """input_ids [B, T] (int), attention_mask [B, T] (1 = token, 0 = padding),
    position_ids [B, T] -> logits [B, T, vocab]."""

    config: GPT2Config

    def setup(self) -> None:
        c = self.config
        block = nn.remat(GPT2Block) if c.remat else GPT2Block
        self.wte = nn.Embed(c.vocab, c.d_model)
        self.wpe = nn.Embed(c.n_positions, c.d_model)
        self.blocks = [block(c.d_model, c.n_heads) for _ in range(c.n_layers)]
        self.ln_f = nn.LayerNorm(epsilon=1e-5)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        position_ids: jax.Array | None = None,
    ) -> jax.Array:
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        h = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.blocks:
            h = block(h, attention_mask)
        return self.wte.attend(self.ln_f(h))


def gpt2_batch(key: jax.Array, batch: int, config: GPT2Config) -> tuple[dict, jax.Array]:
    """A random HF-style batch: (inputs dict, next-token targets); sequences are
    right-padded to random lengths."""
    t = config.n_positions
    k1, k2 = jax.random.split(key)
    ids = jax.random.randint(k1, (batch, t), 0, config.vocab)
    lengths = jax.random.randint(k2, (batch, 1), t // 2, t + 1)
    mask = (jnp.arange(t)[None] < lengths).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t), (batch, t))
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    return inputs, jnp.roll(ids, -1, axis=1)
