"""The character-level corpus shipped in pjit_pipe/models/data: vocabulary, batches, sampling."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


@dataclass(frozen=True)
class CharCorpus:
    """A text as integer ids over its own sorted character set."""

    text: str

    @classmethod
    def load(cls, path: Path = CORPUS) -> CharCorpus:
        return cls(path.read_text(encoding="utf-8"))

    @property
    def chars(self) -> str:
        return "".join(sorted(set(self.text)))

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ValueError(f"text: characters {unknown} are not in the corpus vocabulary")
        return np.array([index[c] for c in text], dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def batch(self, rng: np.random.Generator, batch: int, seq_len: int) -> tuple:
        """(inputs, next-character targets), each [batch, seq_len], from random offsets."""
        data = self.encode(self.text)
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        x = np.stack([data[s : s + seq_len] for s in starts])
        y = np.stack([data[s + 1 : s + seq_len + 1] for s in starts])
        return x, y


def sample(apply_fn, params, prompt: np.ndarray, steps: int, seq_len: int, key: jax.Array):
    """Extend `prompt` by `steps` tokens, sampling from apply_fn(params, tokens[None])."""
    tokens = list(map(int, prompt))

    @jax.jit
    def next_logits(window: jax.Array) -> jax.Array:
        return apply_fn(params, window[None])[0]

    for _ in range(steps):
        window = np.array(tokens[-seq_len:], dtype=np.int32)
        pad = seq_len - len(window)
        logits = next_logits(jnp.asarray(np.pad(window, (0, pad))))[len(window) - 1]
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits)))
    return np.array(tokens, dtype=np.int32)
