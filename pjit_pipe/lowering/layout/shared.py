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

Holders are matched by the leaf's identity, its place in the shared unit's
tree, never by where a holder keeps it: the device layout (flat_buffers.py)
may put the same leaf in a different buffer at a different offset on each
holder. A size class ("float32#2048#k") counts the same-sized leaves before it
in its stage's tree, and a shaped buffer (a leaf split over 'tensor') the
same-shaped ones, so an embedding behind a block's equally large kernel is
class #4 on one holder and #0 on another. Each leaf's total is summed from,
and written back to, wherever each holder keeps it. Leaves that every holder
keeps side by side are summed as one run, one slice per holder buffer.

Under ZeRO (zero.py) the rows are reduce-scattered over 'data' after this sum,
not before: replica 0 of each holder writes the total into its local rows and
the other replicas write zeros, so the reduce-scatter hands every slice the
total exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pjit_pipe.errors import CutError
from pjit_pipe.lowering.comms.topology import over_devices
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, dtype_of, is_shaped


def unit_slots(spec: FlatSpec, s: int, unit: str) -> list[tuple[str, int, int]]:
    """(buffer key, start, elements) of each leaf of `unit` in stage s's parameters,
    in the order of the unit's own tree, which is the same in every holder."""
    tree = spec.treedefs[s].unflatten(spec.avals[s])
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [
        slot
        for path, slot in zip(paths, spec.slots[s], strict=True)
        if getattr(path[0], "key", None) == unit
    ]


def unit_keys(spec: FlatSpec, s: int, unit: str) -> list[str]:
    """The buffer key of each leaf of `unit` in stage s's parameters, in leaf order."""
    return [key for key, _, _ in unit_slots(spec, s, unit)]


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


@dataclass
class _Run:
    """Consecutive leaves of one tied unit whose holders keep them as one slice.

    `total`: the total buffer the run sums into (a dtype's 1-D total, or a shaped
    leaf's own); `offset`, `length`: where in a 1-D total (length None: the whole
    shaped total). `groups`: per buffer key the holders keep the run under, the
    start of the run in that buffer per (position, chunk) and which (position,
    chunk) keep it there, both (P, v).
    """

    total: str
    offset: int
    length: int | None
    groups: dict[str, tuple[np.ndarray, np.ndarray]]

    def extends(self, leaf: _Run) -> bool:
        """Whether `leaf` (one leaf's run) continues this run in every holder's buffer."""
        if self.length is None or leaf.length is None or self.total != leaf.total:
            return False
        if leaf.offset != self.offset + self.length or leaf.groups.keys() != self.groups.keys():
            return False
        return all(
            np.array_equal(holds, leaf.groups[key][1])
            and np.array_equal(
                np.where(holds, starts + self.length, 0), np.where(holds, leaf.groups[key][0], 0)
            )
            for key, (starts, holds) in self.groups.items()
        )


class SharedGrads:
    """Sums the gradients of shared units over the stages holding them.

    shared: unit name (a key of the stage parameter dicts) -> virtual stages
    holding it. held[p][c]: the virtual stage at position p, chunk c.

    Holders are paired leaf by leaf, by the leaf's place in the unit's tree: each
    holder may keep the same leaf under another buffer key and at another offset
    (a size class counts the same-sized leaves before it in its stage's tree,
    flat_buffers.py), so a leaf's total gathers every holder's piece from
    wherever that holder keeps it, and is written back there.
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
        self.runs: list[_Run] = []  # in offset order within each 1-D total
        P, v = len(held), len(held[0])
        flat_sizes: dict[str, int] = {}
        for unit, stages in sorted(shared.items()):
            # Per (position, chunk) holding the unit: its leaves' (key, start, elements).
            slots = {
                (p, c): unit_slots(spec, held[p][c], unit)
                for p in range(P)
                for c in range(v)
                if held[p][c] in stages
            }
            for i in range(len(next(iter(slots.values()), []))):
                groups: dict[str, tuple[np.ndarray, np.ndarray]] = {}
                for (p, c), leaves in slots.items():
                    key, start, n = leaves[i]
                    starts, holds = groups.setdefault(
                        key, (np.zeros((P, v), np.int32), np.zeros((P, v), bool))
                    )
                    starts[p, c], holds[p, c] = start, True
                keys = sorted(groups)
                if any(is_shaped(k) for k in keys) and not all(is_shaped(k) for k in keys):
                    raise CutError(
                        f"shared: leaf {i} of {unit!r} is split over 'tensor' on some of "
                        f"stages {tuple(sorted(stages))} only; annotate every copy alike"
                    )
                if is_shaped(keys[0]):
                    total = f"{unit}|{i}"
                    self.totals[total] = (spec.shapes[keys[0]], dtype_of(keys[0]))
                    self.runs.append(_Run(total, 0, None, groups))
                    continue
                total = dtype_of(keys[0])
                offset = flat_sizes.get(total, 0)
                flat_sizes[total] = offset + n
                leaf = _Run(total, offset, n, groups)
                last = next((r for r in reversed(self.runs) if r.total == total), None)
                if last is not None and last.extends(leaf):
                    last.length += n
                else:
                    self.runs.append(leaf)
        self.totals.update({k: ((n,), k) for k, n in flat_sizes.items()})
        self.flat_totals = set(flat_sizes)  # the 1-D totals, one per dtype

    def __call__(
        self, local: Buffers, reduced: Buffers, first_replica_only: bool = False
    ) -> Buffers:
        """local, reduced: this device's (v, L) gradient rows before and after the
        replica reduction -> `reduced` with every shared slice replaced by its total.
        With `first_replica_only` (ZeRO: `reduced` is `local`, reduce-scattered
        afterwards) replica 0 writes the totals and the other replicas zeros."""
        pos = jnp.asarray(self.positions)[lax.axis_index(self.axes)]
        # A shaped total sums its one run whole; a flat total is concatenated from
        # its runs (appended in offset order), not scattered into: `.at[a:b].add`
        # over a whole row lowers to a scatter with a zero-size index constant, which
        # shard_map passes in as an operand, and a zero-size operand crashes jax
        # 0.11's compiler (see benchmarks/repro_tied_xla_segfault.py).
        pieces: dict[str, list[jax.Array]] = {k: [] for k in self.totals}
        for run in self.runs:
            shape, dtype = self.totals[run.total]
            summed = jnp.zeros(shape if run.length is None else (run.length,), dtype)
            for key, (starts, holds) in run.groups.items():
                for c in range(starts.shape[1]):
                    start, mine = jnp.asarray(starts[:, c])[pos], jnp.asarray(holds[:, c])[pos]
                    piece = (
                        local[key][c]
                        if run.length is None
                        else lax.dynamic_slice(local[key][c], (start,), (run.length,))
                    )
                    summed = summed + jnp.where(mine, piece, 0)
            pieces[run.total].append(summed)
        total = {
            k: jnp.concatenate(p) if k in self.flat_totals else p[0] for k, p in pieces.items()
        }
        total = over_devices(lax.psum, total, self.axes)
        if first_replica_only:
            first = lax.axis_index("data") == 0
            total = {k: jnp.where(first, b, 0) for k, b in total.items()}
        # A row that a concatenate has just built is copied whole before an in-place
        # write into it, unless a barrier stands between the two (XLA:CPU 0.10-0.12).
        out = lax.optimization_barrier(dict(reduced))
        for run in self.runs:
            for key, (starts, holds) in run.groups.items():
                for c in range(starts.shape[1]):
                    start, mine = jnp.asarray(starts[:, c])[pos], jnp.asarray(holds[:, c])[pos]
                    if run.length is None:
                        out[key] = (
                            out[key].at[c].set(jnp.where(mine, total[run.total], out[key][c]))
                        )
                        continue
                    # Only the run's elements are read and written, in place: a whole
                    # row cut out and set back costs XLA copies of the row-long buffer.
                    n = run.length
                    old = lax.dynamic_slice(out[key], (c, start), (1, n))
                    new = jnp.where(mine, total[run.total][run.offset : run.offset + n][None], old)
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
