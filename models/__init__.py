"""Example models for pjit_pipe: plain Flax modules that also run unpipelined."""

from models.gpt import GPT, GPTConfig, lm_loss
from models.mlp import Chain, ResidualMLP, hetero_layers, mse_loss

__all__ = ["GPT", "Chain", "GPTConfig", "ResidualMLP", "hetero_layers", "lm_loss", "mse_loss"]
