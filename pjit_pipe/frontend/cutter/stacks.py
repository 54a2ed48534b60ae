"""nn.scan stacks split between pipeline stages: rows of stacked parameters.

A stage that runs iterations [first, stop) of an `nn.scan` over L layers
owns rows [first, stop) of each of the stack's parameters (stacked on axis
0), as the unit `name[first:stop]`; the rows of all stages concatenate back
into the stack (parameters, gradients, optax state). See `trace.py` for how
a stage runs only its iterations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.frontend.cutter.adapters import Path
from pjit_pipe.frontend.cutter.events import Event

Rows = tuple[int, int]  # [first, stop) rows of a stacked (nn.scan) parameter


def rows_of(tree: Any, rows: Rows | None, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """Rows [first, stop) of every leaf of `tree` (shapes too; other `is_leaf` nodes as is)."""
    if rows is None:
        return tree
    first, stop = rows

    def cut(a: Any) -> Any:
        if _is_aval(a):
            return jax.ShapeDtypeStruct((stop - first, *a.shape[1:]), a.dtype)
        return a[first:stop] if hasattr(a, "shape") else a

    return jax.tree.map(cut, tree, is_leaf=is_leaf)


def stack(parts: Sequence[Any]) -> Any:
    """Concatenate row blocks of one stacked subtree (in row order) along axis 0."""

    def cat(*blocks: Any) -> Any:
        if _is_aval(blocks[0]):
            rows = sum(b.shape[0] for b in blocks)
            sharding = getattr(blocks[0], "sharding", None)
            return jax.ShapeDtypeStruct(
                (rows, *blocks[0].shape[1:]), blocks[0].dtype, sharding=sharding
            )
        sharding = getattr(blocks[0], "sharding", None)
        if sharding is not None and not isinstance(blocks[0], jax.core.Tracer):
            blocks = [jax.device_put(b, sharding) for b in blocks]  # one stage's devices
        return jnp.concatenate(blocks)

    return jax.tree.map(cat, *parts)


def _is_aval(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def _scan_spans(events: Sequence[Event]) -> list[tuple[str, int, int]]:
    """(unit name, event index, length) of every nn.scan that can be cut inside."""
    return [
        ("/".join(e.path) if e.path else e.name, i, e.iterations)
        for i, e in enumerate(events)
        if e.iterations
    ]


def scan_share(events: Sequence[Event], segments: Sequence[Any]) -> list[dict[str, float]]:
    """Per segment: the fraction of each scan stack's iterations it runs."""
    shares: list[dict[str, float]] = []
    for seg in segments:
        lo = seg.start or 0
        hi = len(events) if seg.stop is None else seg.stop
        shares.append(
            {
                name: (min(hi, i + n) - max(lo, i)) / n
                for name, i, n in _scan_spans(events)
                if max(lo, i) < min(hi, i + n)
            }
        )
    return shares


def split_stacks(
    events: Sequence[Event],
    bounds: Sequence[int | None],
    keys: list[list[str]],
    units: dict[str, Path],
) -> tuple[list[list[str]], dict[str, Path], dict[str, Rows]]:
    """Give each stage that runs some iterations of an nn.scan stack the unit
    `name[first:stop]` (those rows of its stacked parameters) instead of the whole."""
    units, rows = dict(units), {}
    ends = [*bounds[1:], len(events)]
    for name, i, n in _scan_spans(events):
        if name not in units:  # a parameter-free scan
            continue
        spans = [(max(b or 0, i) - i, min(e, i + n) - i) for b, e in zip(bounds, ends, strict=True)]
        if all(stop - first in (0, n) for first, stop in spans):
            continue  # one stage runs the whole stack
        for s, (first, stop) in enumerate(spans):
            if name not in keys[s]:
                continue
            if first >= stop:
                raise ValueError(
                    f"pipeline: the stacked parameters of {name} (nn.scan) are split between "
                    f"stages, but stage {s} reads them outside the scan; read them only "
                    "inside the scan, or cut at pjit_pipe.boundary() markers outside it"
                )
            part = f"{name}[{first}:{stop}]"
            keys[s] = sorted([part if k == name else k for k in keys[s]])
            units[part], rows[part] = units[name], (first, stop)
        del units[name]
    return keys, units, rows
