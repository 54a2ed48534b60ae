"""The whole model's tree norms under ZeRO: one reduction of the slices' norms.

With `zero=True` each replica runs optax on its slices of its stages' buffers
(zero.py), so a transform that reads a norm of the whole update
(`optax.clip_by_global_norm`, any `optax.tree.norm` user) would see one slice.
As in global_norm.py the update is traced in passes: each pass records the
local reduction of one norm call (each device's sum of squares of its slices,
or their largest magnitude) and one psum (or pmax) over 'data' and 'stage'
makes it global. 'tensor' needs nothing: inside the step 'tensor' is an
automatic axis, so a reduction of a buffer split over it covers every part.

Each element counts once: a buffer that ZeRO does not cut (every replica holds
it whole) counts on replica 0 only, and a tied unit's copy on a holder other
than its first stage not at all (the first holder counts it, as in
optimizer.py). Padding of the flat rows is zero and adds nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pjit_pipe.lowering.comms.topology import over_devices
from pjit_pipe.lowering.layout.flat_buffers import FlatSpec, is_shaped
from pjit_pipe.lowering.layout.global_norm import SUM, StageNorms, stage_norms
from pjit_pipe.lowering.layout.shared import unit_keys, unit_range

AXES = ("data", "stage")


class SliceNorms:
    """Global tree norms of one ZeRO update (see the module docstring).

    dims: per buffer key, the dimension ZeRO cuts (zero.py) or None; D: the
    replicas; spec: the parameters' layout; held[p][c]: the virtual stage at
    position p, chunk c; shared: tied unit -> the virtual stages holding it.
    """

    def __init__(
        self,
        dims: Mapping[str, int | None],
        D: int,
        spec: FlatSpec,
        held: Sequence[Sequence[int]],
        shared: Mapping[str, Sequence[int]],
    ):
        self.dims, self.D = dict(dims), D
        P, v = len(held), len(held[0])
        # Per flat key, per tied unit not counted there: its (start, length) per (P, v).
        self.ranges: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        # Per shaped key: whether (p, c) keeps an uncounted tied leaf in it. (P, v)
        self.skipped: dict[str, np.ndarray] = {}
        for unit, holders in sorted(shared.items()):
            first = min(holders)
            for key in dims:
                if is_shaped(key):
                    continue
                starts, lengths = np.zeros((P, v), np.int32), np.zeros((P, v), np.int32)
                for p in range(P):
                    for c in range(v):
                        s = held[p][c]
                        r = unit_range(spec, s, unit, key) if s in holders and s != first else None
                        if r is not None:
                            starts[p, c], lengths[p, c] = r
                if lengths.any():
                    self.ranges.setdefault(key, []).append((starts, lengths))
            for p in range(P):
                for c in range(v):
                    s = held[p][c]
                    if s in holders and s != first:
                        for key in unit_keys(spec, s, unit):
                            if is_shaped(key):
                                self.skipped.setdefault(key, np.zeros((P, v), bool))[p, c] = True

    def _counted(self, key: str, shape: tuple[int, ...], pos, c: int, r) -> jax.Array | None:
        """Which elements of this replica's slice of buffer `key` (chunk c) it counts."""
        dim = self.dims[key]
        mask = None if dim is not None else (r == 0)
        if key in self.skipped:
            keep = ~jnp.asarray(self.skipped[key][:, c])[pos]
            mask = keep if mask is None else mask & keep
        for starts, lengths in self.ranges.get(key, []):
            idx = jnp.arange(shape[0]) + (r * shape[0] if dim is not None else 0)
            start, n = jnp.asarray(starts[:, c])[pos], jnp.asarray(lengths[:, c])[pos]
            keep = (idx < start) | (idx >= start + n)
            mask = keep if mask is None else mask & keep
        return mask

    def masker(self, pos, c: int, r) -> Callable[[Any], Any]:
        """The mask StageNorms applies to a tree of chunk c's slices (other trees pass)."""

        def mask(tree: Any) -> Any:
            if not isinstance(tree, Mapping) or set(tree) != set(self.dims):
                return tree
            out = {}
            for k, a in tree.items():
                m = self._counted(k, jnp.shape(a), pos, c, r)
                out[k] = a if m is None else jnp.where(m, a, jnp.zeros((), jnp.result_type(a)))
            return out

        return mask

    def known(
        self, calls: int, update: Callable[[int], Any], chunks: int, pos, r
    ) -> list[jax.Array]:
        """The global value of each of `calls` norm calls of the update; `update(c)`
        traces chunk c's optax update (its outputs are not used)."""
        known: list[jax.Array] = []
        for k in range(calls):
            local, combine = [], SUM
            for c in range(chunks):
                with stage_norms(StageNorms(known, k, mask=self.masker(pos, c, r))) as norms:
                    update(c)
                local.append(norms.recorded)
                combine = norms.combine
            total = functools.reduce(jnp.add if combine == SUM else jnp.maximum, local)
            known.append(over_devices(lax.psum if combine == SUM else lax.pmax, total, AXES))
        return known
