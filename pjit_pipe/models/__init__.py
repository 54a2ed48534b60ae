"""Example models for pjit_pipe: plain Flax modules that also run unpipelined."""

from pjit_pipe.models.cnn import CNN
from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss
from pjit_pipe.models.gpt2 import GPT2LM, GPT2Config, gpt2_batch
from pjit_pipe.models.llama import Llama, LlamaConfig
from pjit_pipe.models.mlp import Chain, ResidualMLP, hetero_layers, mse_loss

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
