"""The small convolutional classifier of the Flax documentation's MNIST example.

Two conv + relu + average-pool stages, a flatten, two dense layers; written
here at a tiny width (the architecture, not Flax's file). Its top-level calls
give the cutter three cut points: the second conv and the two dense layers.
"""

from __future__ import annotations

import flax.linen as nn
import jax


class CNN(nn.Module):
    """images [B, H, W, C] -> logits [B, classes]."""

    features: tuple[int, int] = (8, 16)
    hidden: int = 32
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for f in self.features:
            x = nn.relu(nn.Conv(features=f, kernel_size=(3, 3))(x))
            x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(features=self.hidden)(x))
        return nn.Dense(features=self.classes)(x)
