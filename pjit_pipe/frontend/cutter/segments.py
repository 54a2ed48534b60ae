"""The clean segments between a model's candidate cut points, probed one by one.

This is the cutter's check that a cut is *clean* (see `cut.py`), kept apart
from choosing and balancing the cut: each segment between two candidate cut
points is traced as a stage of its own, with the model input and every
skipped call's output passed as arguments, and a cut whose following segment
reads any of them is dropped (the segment merges into the one before). A
segment also records the parameter units it reads and its FLOPs, and the
last one the model outputs it leaves to earlier stages (`StaleOutput`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from pjit_pipe.frontend.cutter.adapters import Model, Path
from pjit_pipe.frontend.cutter.analysis import liveness, reads_of_each_output
from pjit_pipe.frontend.cutter.events import Event
from pjit_pipe.frontend.cutter.stage_cut import StaleOutput
from pjit_pipe.frontend.cutter.trace import Run


def path_key(entry: Any) -> Any:
    """The dict key or list index of one step of a pytree path."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    raise TypeError(f"unexpected pytree path entry {entry!r}")


def unit_of(path: Path, children: Sequence[Path]) -> Path:
    """The unit of the leaf at `path`: the longest child path that prefixes it, else
    its shortest prefix that no child path starts with (its top-level name when
    the children are top-level)."""
    owners = [c for c in children if path[: len(c)] == c]
    if owners:
        return max(owners, key=len)
    for k in range(1, len(path)):
        if not any(c[:k] == path[:k] for c in children):
            return path[:k]
    return path


@dataclass(frozen=True)
class Segment:
    start: int | None  # event index where it begins; None: the model input
    stop: int | None  # event index where it ends; None: the model output
    keys: frozenset[str]  # names of the parameter units it reads
    flops: float
    clean: bool
    reads: tuple[str, ...] = ()  # what it reads from before its start (unclean: why)
    stale: tuple[StaleOutput, ...] = ()  # the last one: model outputs it cannot make


MODEL_INPUT = "the model input"


@dataclass(frozen=True)
class Recorded:
    """A model's events for inputs like x, and what each probe of a segment needs."""

    model: Model
    events: tuple[Event, ...]
    x_aval: Any
    param_avals: dict
    levels: frozenset[Path]
    children: tuple[Path, ...]
    out_aval: Any


def probe(rec: Recorded, start: int | None, stop: int | None) -> Segment:
    """Trace the model as stage [start, stop) with every hidden input as an argument."""
    events = rec.events
    calls_before = [i for i in range(start or 0) if events[i].kind == "call"]
    act_aval = rec.x_aval if start is None else events[start].act

    def segment(params, x, skips, act):
        if start is None:
            return rec.model.run(params, act, Run(stop=stop, expected=events, levels=rec.levels))
        skipped = dict(zip(calls_before, skips, strict=True))
        run = Run(start, stop, act, skipped, events, rec.levels)
        return rec.model.run(params, x, run)

    skip_avals = [events[i].out for i in calls_before]
    closed = jax.make_jaxpr(segment)(rec.param_avals, rec.x_aval, skip_avals, act_aval)
    live = liveness(closed.jaxpr)
    used = iter(live.used)
    keys = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(rec.param_avals)[0]:
        if next(used):
            keys.add("/".join(map(str, unit_of(tuple(map(path_key, path)), rec.children))))
    # Who each hidden input is: the model input's leaves, then each skipped call's.
    owners = [MODEL_INPUT] * len(jax.tree.leaves(rec.x_aval))
    for i, out in zip(calls_before, skip_avals, strict=True):
        owners += [events[i].name] * len(jax.tree.leaves(out))
    hidden = [next(used) for _ in owners]
    if start is None or not any(hidden):
        return Segment(start, stop, frozenset(keys), live.flops, True)
    reads = tuple(dict.fromkeys(o for o, h in zip(owners, hidden, strict=True) if h))
    first = len(jax.tree.leaves(rec.param_avals))
    stale = _stale_outputs(closed.jaxpr, first, owners, rec.out_aval) if stop is None else ()
    clean = bool(stale) and len(stale) < len(jax.tree.leaves(rec.out_aval))
    return Segment(start, stop, frozenset(keys), live.flops, clean, reads, stale)


def _stale_outputs(
    jaxpr, first: int, owners: Sequence[str], out_aval: Any
) -> tuple[StaleOutput, ...]:
    """The model outputs of a last stage that read a hidden input (jaxpr inputs
    first, first+1, ..., one per entry of `owners`), each with the calls (or the
    model input) it reads from before the stage."""
    flat = jax.tree_util.tree_flatten_with_path(out_aval)[0]
    stale = []
    for (path, _), reads in zip(flat, reads_of_each_output(jaxpr), strict=True):
        hidden = reads[first : first + len(owners)]
        producers = tuple(dict.fromkeys(o for o, h in zip(owners, hidden, strict=True) if h))
        if producers:
            stale.append(StaleOutput(jax.tree_util.keystr(path), producers))
    return tuple(stale)


def _candidates(events: Sequence[Event]) -> list[int]:
    """Event indices where a stage may begin: markers if the model has any, else every
    call after the first; and the iterations of nn.scan stacks. The event must
    receive at least one array."""
    markers = any(e.kind == "boundary" for e in events)
    return [
        i
        for i, e in enumerate(events)
        if e.act is not None and (e.kind != "call" if markers else i > 0)
    ]


def clean_segments(rec: Recorded) -> tuple[list[Segment], dict[str, tuple[str, ...]]]:
    """Segments between candidate cuts, dropping cuts that are not clean; and each
    dropped cut's event name -> what the code after it read from before it."""
    bounds: list[int | None] = [None, *_candidates(rec.events)]
    segments: list[Segment] = []
    dropped: dict[str, tuple[str, ...]] = {}
    for j, start in enumerate(bounds):
        stop = bounds[j + 1] if j + 1 < len(bounds) else None
        seg = probe(rec, start, stop)
        while not seg.clean:  # merge with the previous segment and try again
            dropped[rec.events[seg.start].name] = seg.reads
            prev = segments.pop()
            seg = probe(rec, prev.start, stop)
        segments.append(seg)
    return segments, dropped
