"""MLP models: a residual MLP, and a chain of heterogeneous layers for pipelining tests."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class ResidualBlock(nn.Module):
    """x + W2 gelu(W1 ln(x)), with its own hidden width."""

    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(self.hidden)(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


class ResidualMLP(nn.Module):
    """Input projection, `n_layers` residual blocks, output projection."""

    d_model: int = 32
    hidden: int = 64
    n_layers: int = 4
    d_out: int = 8

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.d_model, name="proj_in")(x)
        for i in range(self.n_layers):
            x = ResidualBlock(self.hidden, name=f"block_{i}")(x)
        return nn.Dense(self.d_out, name="proj_out")(nn.LayerNorm(name="ln_out")(x))


class Chain(nn.Module):
    """Calls its layers in order: the plain 'list of layers in a loop' model."""

    layers: Sequence[nn.Module]

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x


class Dense(nn.Module):
    """A dense layer with a tanh, so a chain of them is not one linear map."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(nn.Dense(self.features)(x))


def hetero_layers(widths: Sequence[int] = (24, 48, 16, 40, 32, 12, 20, 8)) -> list[nn.Module]:
    """Layers whose widths all differ, so every stage has different parameter shapes."""
    return [Dense(w) for w in widths[:-1]] + [nn.Dense(widths[-1])]


def mse_loss(out: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error."""
    return jnp.mean((out - target) ** 2)
