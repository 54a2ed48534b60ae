"""Cut a Flax module into pipeline stages and split its parameters to match.

Candidate cut points are the module's events (see `trace.py`): every
top-level submodule call, or only the `boundary()` markers when the model has
any. A candidate is kept only if it is a *clean* cut: the code after it reads
nothing computed before it except its activation. We check that on the jaxpr
of each segment, traced with the model input and every skipped call's output
passed as arguments: if any of them reaches the segment's output, the cut in
front of the segment is dropped. What crosses a cut is the activation of the
event there: every array in its arguments (see `trace.py`), so a `(hidden,
mask)` pair or integer positions cross as they are. The remaining segments are
grouped into stages by estimated FLOPs (or parameter count).

A unit read by several stages (tied weights: an embedding that the LM head
reuses through `attend`) is held by each of them: `split` gives every holder
a copy, the lowering sums their gradients before the update (see `shared`),
and `merge` takes the first holder's copy.

Parameters are split into *units*, the subtrees a stage owns whole: a linen
module's top-level names (`params['params'][name]`), an NNX module's children
(see `adapters.py`). A stage's parameters are a dict of its units, named by
their paths ('blocks_0' in linen, 'blocks/0' in NNX), and split/merge
round-trip exactly: checkpoints never depend on the pipeline layout. The
result, `StageCut`, and its split/merge live in stage_cut.py.

An `nn.scan` stack may be cut between iterations (see `trace.py`): a stage
running iterations [a, b) of scan `layers` owns the unit `layers[a:b]`, rows
[a, b) of every stacked parameter, and `merge` concatenates the stages'
rows back into the one stacked tree (parameters, gradients, optax state).
With balance="time" the segments are weighed by their measured forward and
backward time (`measure.py`) instead of FLOPs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.errors import CutError, OptionError
from pjit_pipe.frontend.cutter.adapters import Model, Path, as_model
from pjit_pipe.frontend.cutter.analysis import liveness
from pjit_pipe.frontend.cutter.balance import balance as balance_costs
from pjit_pipe.frontend.cutter.stacks import scan_share as scan_share_of
from pjit_pipe.frontend.cutter.stacks import split_stacks
from pjit_pipe.frontend.cutter.stage_cut import StageCut, get_path, imbalance
from pjit_pipe.frontend.cutter.trace import Event, Run, with_iterations

BALANCE = ("flops", "params", "time")


def _avals(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _key(entry: Any) -> Any:
    """The dict key or list index of one step of a pytree path."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    raise TypeError(f"unexpected pytree path entry {entry!r}")


def _units(param_avals: dict, children: Sequence[Path]) -> dict[str, Path]:
    """Unit name -> path, for every unit that holds parameters; a leaf belongs to the
    longest child path that prefixes it, else to its top-level name."""
    units: dict[str, Path] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(param_avals)[0]:
        unit = _unit_of(tuple(map(_key, path)), children)
        units["/".join(map(str, unit))] = unit
    return units


def _unit_of(path: Path, children: Sequence[Path]) -> Path:
    owners = [c for c in children if path[: len(c)] == c]
    return max(owners, key=len) if owners else path[:1]


def _is_aval(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


@dataclass(frozen=True)
class _Segment:
    start: int | None  # event index where it begins; None: the model input
    stop: int | None  # event index where it ends; None: the model output
    keys: frozenset[str]  # names of the parameter units it reads
    flops: float
    clean: bool


IMBALANCE_WARNING = 1.5


def _probe(model: Model, events, x_aval, param_avals, start, stop) -> _Segment:
    """Trace the model as stage [start, stop) with every hidden input as an argument."""
    calls_before = [i for i in range(start or 0) if events[i].kind == "call"]
    act_aval = x_aval if start is None else events[start].act

    def segment(params, x, skips, act):
        if start is None:
            return model.run(params, act, Run(stop=stop, expected=events))
        run = Run(start, stop, act, dict(zip(calls_before, skips, strict=True)), events)
        return model.run(params, x, run)

    skip_avals = [events[i].out for i in calls_before]
    closed = jax.make_jaxpr(segment)(param_avals, x_aval, skip_avals, act_aval)
    live = liveness(closed.jaxpr)
    used = iter(live.used)
    keys = set()
    for path, _ in jax.tree_util.tree_flatten_with_path(param_avals)[0]:
        if next(used):
            keys.add("/".join(map(str, _unit_of(tuple(map(_key, path)), model.children))))
    hidden = [next(used) for _ in jax.tree.leaves((x_aval, skip_avals))]
    clean = not (start is not None and any(hidden))
    return _Segment(start, stop, frozenset(keys), live.flops, clean)


def _candidates(events: Sequence[Event]) -> list[int]:
    """Event indices where a stage may begin: markers if the model has any, else every
    top-level call after the first; and the iterations of nn.scan stacks. The event
    must receive at least one array."""
    markers = any(e.kind == "boundary" for e in events)
    return [
        i
        for i, e in enumerate(events)
        if e.act is not None and (e.kind != "call" if markers else i > 0)
    ]


def _clean_segments(model: Model, events, x_aval, param_avals) -> list[_Segment]:
    """Segments between candidate cuts, dropping cuts that are not clean."""
    bounds: list[int | None] = [None, *_candidates(events)]
    segments: list[_Segment] = []
    for j, start in enumerate(bounds):
        stop = bounds[j + 1] if j + 1 < len(bounds) else None
        seg = _probe(model, events, x_aval, param_avals, start, stop)
        while not seg.clean:  # merge with the previous segment and try again
            prev = segments.pop()
            seg = _probe(model, events, x_aval, param_avals, prev.start, stop)
        segments.append(seg)
    return segments


@dataclass(frozen=True)
class _Traced:
    """A model recorded for inputs like x: its events and clean segments."""

    model: Model
    events: tuple[Event, ...]
    segments: list[_Segment]
    x_aval: Any
    param_avals: dict
    units: dict[str, Path]

    def one_each(self) -> StageCut:
        """The cut with one stage per clean segment (the planner's layers)."""
        return StageCut(
            model=self.model,
            events=self.events,
            bounds=tuple(s.start for s in self.segments),
            keys=tuple(tuple(sorted(s.keys)) for s in self.segments),
            flops=tuple(s.flops for s in self.segments),
            x_aval=self.x_aval,
            param_avals=self.param_avals,
            units=self.units,
        )


def _trace(module: Any, variables: Any, x: Any) -> _Traced:
    model = as_model(module)
    param_avals = _avals(model.params(variables))
    units = _units(param_avals, model.children)
    x_aval = _avals(x)
    recorder = Run()
    jax.eval_shape(lambda p, xs: model.run(p, xs, recorder), param_avals, x_aval)
    events = with_iterations(tuple(recorder.events))
    if recorder.wrapped_root is not None:
        raise CutError(
            f"pipeline: {model.name}.__call__ runs inside a Flax transform (nn.jit, "
            "nn.remat, ... applied to the root module), which hides its layer calls from "
            "the stage cutter; remove it from the root (the pipeline compiles the whole "
            "step anyway) and put transforms on the layers instead"
        )
    segments = _clean_segments(model, events, x_aval, param_avals)
    return _Traced(model, events, segments, x_aval, param_avals, units)


def layer_cut(module: Any, variables: Any, x: Any) -> StageCut:
    """`module` cut at every clean cut point: stage k is layer k of a plan
    (`pjit_pipe.planner.Plan.stages` ranges index these)."""
    return _trace(module, variables, x).one_each()


def _check_layers(layers: Sequence[tuple[int, int]], count: int, stages: int) -> list[int]:
    """The first layer of each stage, from inclusive (first, last) ranges that must
    cover layers 0..count-1 in order."""
    ranges = [tuple(r) for r in layers]
    expected = 0
    for first, last in ranges:
        if first != expected or last < first:
            raise OptionError(
                f"layers: expected contiguous inclusive (first, last) ranges from layer 0, "
                f"got {ranges}; range ({first}, {last}) should start at layer {expected}"
            )
        expected = last + 1
    if expected != count or len(ranges) != stages:
        raise OptionError(
            f"layers: {len(ranges)} ranges covering layers 0..{expected - 1}, but the model "
            f"has {count} layers (clean cut segments, see layer_cut) and stages={stages}; "
            "plan the model for these inputs (pjit_pipe.plan_pipeline)"
        )
    return [first for first, _ in ranges]


def cut_module(
    module: Any,
    variables: Any,
    x: Any,
    stages: int,
    balance: str = "flops",
    layers: Sequence[tuple[int, int]] | None = None,
) -> StageCut:
    """Cut `module` (linen or NNX, or its `Model` view) into `stages` stages for
    inputs shaped like `x` (one microbatch); `variables` are its parameters.
    `layers`: the stages as inclusive (first, last) ranges of the model's layers
    (its clean segments; a planner's `Plan.stages`) instead of balancing."""
    if balance not in BALANCE:
        raise OptionError(f"balance: expected one of {', '.join(BALANCE)}, got {balance!r}")
    traced = _trace(module, variables, x)
    model, events, segments = traced.model, traced.events, traced.segments
    x_aval, param_avals, units = traced.x_aval, traced.param_avals, traced.units
    if len(segments) < stages:
        names = [events[s.start].name for s in segments[1:]]
        scans = [
            f"{e.name} (nn.scan)"
            for e in events
            if e.transform == "Scan" and e.kind == "call" and not e.iterations
        ]
        hint = (
            f"; {', '.join(scans)} runs its layers inside one scan that is not cut "
            "between iterations, because its per-iteration outputs (ys) are used or it "
            "runs in reverse: return None as the scan's per-iteration output and run it "
            "forwards, or use a Python loop over the layers (each may be nn.remat'd)"
            if scans
            else ""
        )
        raise CutError(
            f"stages: the model {model.name} has {len(segments) - 1} clean cut "
            f"points ({', '.join(names) or 'none'}), too few for {stages} stages; use a "
            "model with more top-level layers, add pjit_pipe.boundary() markers, or "
            f"use fewer stages/chunks{hint}"
        )
    sizes = {
        k: sum(math.prod(a.shape) for a in jax.tree.leaves(get_path(param_avals, path)))
        for k, path in units.items()
    }
    scan_share = scan_share_of(events, segments)  # a scan iteration weighs 1/L of its stack
    if balance == "flops" or layers is not None:
        costs = [s.flops for s in segments]
    elif balance == "time":  # measured forward + backward of each segment
        from pjit_pipe.frontend.planning.measure import segment_times  # compiles: load on use

        one_each = traced.one_each()
        stage_params = one_each.split(model.variables(param_avals), _is_aval)
        costs = segment_times(one_each.stage_fns(), stage_params, x_aval)
    else:
        costs = [
            float(sum(sizes[k] * scan_share[j].get(k, 1.0) for k in s.keys))
            for j, s in enumerate(segments)
        ]
    if layers is None:
        starts = balance_costs(costs, stages)
    else:
        starts = _check_layers(layers, len(segments), stages)
    ends = [*starts[1:], len(segments)]
    groups = [segments[a:b] for a, b in zip(starts, ends, strict=True)]
    keys = [sorted(set().union(*(s.keys for s in g))) for g in groups]
    unused = sorted(set(units) - set().union(*map(set, keys)))
    keys[0] = sorted(keys[0] + unused)  # never read: they get zero gradients anywhere
    stage_costs = [sum(costs[a:b]) for a, b in zip(starts, ends, strict=True)]
    if layers is None and imbalance(stage_costs) > IMBALANCE_WARNING:
        warnings.warn(
            f"pipeline: the best cut of {model.name} into {stages} stages is imbalanced: "
            f"stage costs ({balance}) {[f'{c:.3g}' for c in stage_costs]}, the largest "
            f"{imbalance(stage_costs):.2f}x the mean; the pipeline runs at the pace of "
            "its slowest stage. Use fewer stages, or add pjit_pipe.boundary() markers "
            "to give the cutter finer cut points",
            stacklevel=2,
        )
    bounds = tuple(g[0].start for g in groups)
    keys, units, rows = split_stacks(events, bounds, keys, units)
    return StageCut(
        model=model,
        events=events,
        bounds=bounds,
        keys=tuple(tuple(k) for k in keys),
        flops=tuple(sum(s.flops for s in g) for g in groups),
        x_aval=x_aval,
        param_avals=param_avals,
        units=units,
        rows=rows,
    )
