"""How the tests compare a result with its reference."""

from typing import Any

import jax
import numpy as np


def rel_err(got: Any, want: Any) -> float:
    """Largest over leaves of max|got - want| / max|want|, in float64 on the host:
    numpy, not jnp, so a comparison compiles nothing (an eager jnp op compiles once
    per leaf shape, about as long as a small pipeline's step runs)."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)))
    return worst
