"""Example models for pjit_pipe: plain Flax modules that also run unpipelined."""

from models.cnn import CNN
from models.gpt import GPT, GPTConfig, lm_loss
from models.gpt2 import GPT2LM, GPT2Config, gpt2_batch
from models.llama import Llama, LlamaConfig
from models.mlp import Chain, ResidualMLP, hetero_layers, mse_loss

__all__ = [
    "CNN",
    "GPT",
    "GPT2LM",
    "Chain",
    "GPT2Config",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ResidualMLP",
    "gpt2_batch",
    "hetero_layers",
    "lm_loss",
    "mse_loss",
]
