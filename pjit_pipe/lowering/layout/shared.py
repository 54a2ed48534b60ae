"""Gradients of parameters that several virtual stages hold (tied weights).

An embedding that the first stage uses for lookup and the last stage reuses
as its LM head is held by both stages (Megatron's approach): each computes
its own gradient contribution, and both must apply the sum, so that their
copies stay equal. Inside the program each device copies the slices of its
local (not yet replica-reduced) gradient rows that belong to shared
parameters into one small buffer laid out by parameter, a psum over every
worker adds all contributions (every microbatch's W runs on exactly one
worker, also after re-routing), and each holder writes the total back over
its replica-reduced rows. One unconditional collective, whatever holds what.

A leaf of a shared unit split over 'tensor' sits in a shaped buffer of its own
(flat_buffers.py), whose key may differ between the holding stages (its
occurrence among same-shaped leaves): its total is a whole buffer, summed from
and written back to whichever key each holder keeps it under.

Under ZeRO (zero.py) the rows are reduce-scattered over 'data' after this sum,
not before: replica 0 of each holder writes the total into its local rows and
the other replicas write zeros, so the reduce-scatter hands every slice the
total exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pjit_pipe.errors import CutError
from pjit_pipe.lowering.comms.topology import over_devices
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, dtype_of, is_shaped


def unit_keys(spec: FlatSpec, s: int, unit: str) -> list[str]:
    """The buffer key of each leaf of `unit` in stage s's parameters, in leaf order."""
    tree = spec.treedefs[s].unflatten(spec.avals[s])
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [
        key
        for path, (key, _, _) in zip(paths, spec.slots[s], strict=True)
        if getattr(path[0], "key", None) == unit
    ]


def unit_range(spec: FlatSpec, s: int, unit: str, key: str) -> tuple[int, int] | None:
    """(start, length) of `unit`'s leaves of dtype `key` in stage s's flat row, or None."""
    treedef = spec.treedefs[s]
    paths = [
        p for p, _ in jax.tree_util.tree_flatten_with_path(treedef.unflatten(spec.avals[s]))[0]
    ]
    slots = [
        (start, n)
        for path, (k, start, n) in zip(paths, spec.slots[s], strict=True)
        if k == key and getattr(path[0], "key", None) == unit
    ]
    if not slots:
        return None
    begin = slots[0][0]
    length = sum(n for _, n in slots)
    if [st for st, _ in slots] != list(np.cumsum([begin] + [n for _, n in slots[:-1]])):
        raise RuntimeError(f"shared parameter {unit}: its {key} leaves are not contiguous")
    return begin, length


class SharedGrads:
    """Sums the gradients of shared units over the stages holding them.

    shared: unit name (a key of the stage parameter dicts) -> virtual stages
    holding it. held[p][c]: the virtual stage at position p, chunk c.
    """

    def __init__(
        self,
        shared: Mapping[str, Sequence[int]],
        spec: FlatSpec,
        held: Sequence[Sequence[int]],
        positions: np.ndarray,
        axes: tuple[str, ...],
    ):
        self.units = sorted(shared)
        self.holders = {unit: tuple(sorted(stages)) for unit, stages in shared.items()}
        self.axes = axes
        self.positions = positions
        # Per total buffer: its shape and dtype. A dtype's flat leaves share one
        # 1-D total; a shaped leaf (split over 'tensor') has one of its own.
        self.totals: dict[str, tuple[tuple[int, ...], str]] = {}
        # (total key, buffer key, offset in the total, length or None for a whole
        # shaped buffer, start table (P, v), holds (P, v))
        self.entries: list[tuple[str, str, int, int | None, np.ndarray, np.ndarray]] = []
        P, v = len(held), len(held[0])
        flat_sizes: dict[str, int] = {}
        for unit, stages in sorted(shared.items()):
            for key in spec.sizes:
                if is_shaped(key):
                    continue
                starts = np.zeros((P, v), np.int32)
                holds = np.zeros((P, v), bool)
                length = None
                for p in range(P):
                    for c in range(v):
                        s = held[p][c]
                        r = unit_range(spec, s, unit, key) if s in stages else None
                        if r is not None:
                            starts[p, c], length = r
                            holds[p, c] = True
                if length:
                    offset = flat_sizes.get(key, 0)
                    self.entries.append((key, key, offset, length, starts, holds))
                    flat_sizes[key] = offset + length
            # (leaf of the unit, shaped key) -> which (position, chunk) keep it there
            shaped: dict[tuple[int, str], np.ndarray] = {}
            for p in range(P):
                for c in range(v):
                    if held[p][c] not in stages:
                        continue
                    for i, key in enumerate(unit_keys(spec, held[p][c], unit)):
                        if is_shaped(key):
                            shaped.setdefault((i, key), np.zeros((P, v), bool))[p, c] = True
            for (i, key), holds in sorted(shaped.items()):
                total = f"{unit}|{i}"
                self.totals[total] = (spec.shapes[key], dtype_of(key))
                self.entries.append((total, key, 0, None, np.zeros((P, v), np.int32), holds))
        self.totals.update({k: ((n,), dtype_of(k)) for k, n in flat_sizes.items()})
        self.flat_totals = set(flat_sizes)  # the 1-D totals, one per dtype

    def __call__(
        self, local: Buffers, reduced: Buffers, first_replica_only: bool = False
    ) -> Buffers:
        """local, reduced: this device's (v, L) gradient rows before and after the
        replica reduction -> `reduced` with every shared slice replaced by its total.
        With `first_replica_only` (ZeRO: `reduced` is `local`, reduce-scattered
        afterwards) replica 0 writes the totals and the other replicas zeros."""
        pos = jnp.asarray(self.positions)[lax.axis_index(self.axes)]
        # A shaped total sums its entries whole; a flat total is concatenated from
        # its entries (appended in offset order), not scattered into: `.at[a:b].add`
        # over a whole row lowers to a scatter with a zero-size index constant, which
        # shard_map passes in as an operand, and a zero-size operand crashes jax
        # 0.11's compiler (see benchmarks/repro_tied_xla_segfault.py).
        pieces: dict[str, list[jax.Array]] = {k: [] for k in self.totals}
        for t, key, _, n, starts, holds in self.entries:
            shape, dtype = self.totals[t] if n is None else ((n,), self.totals[t][1])
            summed = jnp.zeros(shape, dtype)
            for c in range(starts.shape[1]):
                start, mine = jnp.asarray(starts[:, c])[pos], jnp.asarray(holds[:, c])[pos]
                piece = (
                    local[key][c] if n is None else lax.dynamic_slice(local[key][c], (start,), (n,))
                )
                summed = summed + jnp.where(mine, piece, 0)
            pieces[t].append(summed)
        total = {
            k: jnp.concatenate(p) if k in self.flat_totals else sum(p[1:], p[0])
            for k, p in pieces.items()
        }
        total = over_devices(lax.psum, total, self.axes)
        if first_replica_only:
            first = lax.axis_index("data") == 0
            total = {k: jnp.where(first, b, 0) for k, b in total.items()}
        # A row that a concatenate has just built is copied whole before an in-place
        # write into it, unless a barrier stands between the two (XLA:CPU 0.10-0.12).
        out = lax.optimization_barrier(dict(reduced))
        for t, key, offset, n, starts, holds in self.entries:
            for c in range(starts.shape[1]):
                start, mine = jnp.asarray(starts[:, c])[pos], jnp.asarray(holds[:, c])[pos]
                if n is None:
                    out[key] = out[key].at[c].set(jnp.where(mine, total[t], out[key][c]))
                    continue
                # Only the unit's n elements are read and written, in place: a whole
                # row cut out and set back costs XLA copies of the row-long buffer.
                old = lax.dynamic_slice(out[key], (c, start), (1, n))
                new = jnp.where(mine, total[t][offset : offset + n][None], old)
                out[key] = lax.dynamic_update_slice(out[key], new, (c, start))
        # The rows leave as they are: without the barrier XLA:CPU fuses these writes
        # into their readers as well (the norm of the non-finite check, the row
        # optimizer's kernels) and copies the whole (v, L) gradient to keep it for
        # them (zb-v on a tied GPT-2 at 1x1: one row-long copy and one write less).
        return lax.optimization_barrier(out)


def check_shared(shared: Mapping[str, Sequence[int]], stage_params: Sequence[Any]) -> None:
    """Raise unless every shared unit is a key of each holder's parameters, same shapes."""
    for unit, stages in shared.items():
        trees = []
        for s in stages:
            if not isinstance(stage_params[s], Mapping) or unit not in stage_params[s]:
                raise CutError(f"shared: stage {s} holds no parameter unit {unit!r}")
            trees.append(
                jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), stage_params[s][unit])
            )
        if any(t != trees[0] for t in trees):
            raise CutError(
                f"shared: the copies of {unit!r} differ in shape between stages {stages}"
            )
