"""Cut a Flax module into pipeline stages and split its parameters to match.

Candidate cut points are the module's events (see `trace.py`): every call of a
module below a container (the root's children; the blocks of a stack deeper
down, see `nesting.py`), or only the `boundary()` markers when the model has
any; `split_points` names them by path instead of balancing. A candidate is
kept only if it is a *clean* cut: the code after it reads nothing computed
before it except its activation. We check that on the jaxpr of each segment
(`segments.py`), traced with the model input and every skipped call's output
passed as arguments: if any of them reaches the segment's output, the cut in
front of the segment is dropped (the refusal names what the code after it
read). The last stage may leave some of the model's outputs to earlier stages
(the per-block caches a model returns beside its logits) when it reads none of
them itself: they are the cut's `stale_outputs`, and a loss that reads one is
refused by name when the program is built (`StageCut.check_loss`). What
crosses a cut is the activation of the event there: every array in its
arguments (see `trace.py`), so a `(hidden, mask)` pair or integer positions
cross as they are. The remaining segments are grouped into stages by estimated
FLOPs (or parameter count).

A unit read by several stages (tied weights: an embedding that the LM head
reuses through `attend`) is held by each of them: `split` gives every holder
a copy, the lowering sums their gradients before the update (see `shared`),
and `merge` takes the first holder's copy.

Parameters are split into *units*, the subtrees a stage owns whole: the
parameters of each event's module (a linen module's top-level names,
`params['params'][name]`, or the paths of nested blocks, 'transformer/h/0'),
an NNX module's children (see `adapters.py`); a parameter outside them is a
unit of its own. A stage's parameters are a dict of its units, named by
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
from pjit_pipe.frontend.cutter.balance import balance as balance_costs
from pjit_pipe.frontend.cutter.balance import group_costs
from pjit_pipe.frontend.cutter.events import Event, with_iterations
from pjit_pipe.frontend.cutter.nesting import choose_levels, containers_above
from pjit_pipe.frontend.cutter.segments import (
    MODEL_INPUT,
    Recorded,
    Segment,
    clean_segments,
    path_key,
    probe,
    unit_of,
)
from pjit_pipe.frontend.cutter.stacks import scan_share as scan_share_of
from pjit_pipe.frontend.cutter.stacks import split_stacks
from pjit_pipe.frontend.cutter.stage_cut import StageCut, get_path, imbalance
from pjit_pipe.frontend.cutter.trace import Run

BALANCE = ("flops", "params", "flops+params", "time")


def _avals(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _units(param_avals: dict, children: Sequence[Path]) -> dict[str, Path]:
    """Unit name -> path, for every unit that holds parameters (see `unit_of`)."""
    units: dict[str, Path] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(param_avals)[0]:
        unit = unit_of(tuple(map(path_key, path)), children)
        units["/".join(map(str, unit))] = unit
    return units


def _event_paths(model: Model, events: Sequence[Event]) -> tuple[Path, ...]:
    """The parameter subtrees stages own whole: an NNX model's children, else the
    paths of the modules the events call."""
    if model.children:
        return model.children
    return tuple(dict.fromkeys(e.path for e in events if e.path))


def _is_aval(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


IMBALANCE_WARNING = 1.5


@dataclass(frozen=True)
class _Traced:
    """A model recorded for inputs like x: its events and clean segments."""

    rec: Recorded
    segments: list[Segment]
    units: dict[str, Path]
    dropped: dict[str, tuple[str, ...]]

    def cut(self, starts: Sequence[int], **fields: Any) -> StageCut:
        """The cut whose stages begin at these segments (`fields`: StageCut's keys,
        units and rows, where they differ from one segment's)."""
        rec, segments = self.rec, self.segments
        ends = [*starts[1:], len(segments)]
        groups = [segments[a:b] for a, b in zip(starts, ends, strict=True)]
        last = groups[-1][0]
        if segments[-1].stale and last is not segments[-1]:  # fewer outputs are stale
            last = probe(rec, last.start, None)
        keys = tuple(tuple(sorted(set().union(*(s.keys for s in g)))) for g in groups)
        return StageCut(
            model=rec.model,
            events=rec.events,
            bounds=tuple(g[0].start for g in groups),
            keys=fields.pop("keys", keys),
            flops=tuple(sum(s.flops for s in g) for g in groups),
            x_aval=rec.x_aval,
            param_avals=rec.param_avals,
            units=fields.pop("units", self.units),
            levels=rec.levels,
            out_aval=rec.out_aval,
            stale_outputs=last.stale if last.start is not None else (),
            **fields,
        )

    def one_each(self) -> StageCut:
        """The cut with one stage per clean segment (the planner's layers)."""
        return self.cut(range(len(self.segments)))

    def names(self) -> list[str]:
        """The clean cut points' event names, in order."""
        return [self.rec.events[s.start].name for s in self.segments[1:]]


def _trace(module: Any, variables: Any, x: Any, split_points: Sequence[str] = ()) -> _Traced:
    model = as_model(module)
    param_avals = _avals(model.params(variables))
    x_aval = _avals(x)

    def record(levels: frozenset[Path]) -> tuple[Run, Any]:
        recorder = Run(levels=levels)
        out = jax.eval_shape(lambda p, xs: model.run(p, xs, recorder), param_avals, x_aval)
        return recorder, out

    recorder, out_aval = record(frozenset({()}))
    if recorder.wrapped_root is not None:
        lifted = recorder.wrapped_root != model.name  # nn.jit(Model) rather than a decorator
        raise CutError(
            f"pipeline: {model.name}.__call__ runs inside a Flax transform "
            f"{f'({recorder.wrapped_root}) ' if lifted else ''}that the stage cutter cannot "
            "see through (it sees through nn.jit and nn.remat only as the outermost "
            "decorator of the root's __call__); take it "
            f"off the root in one line, `class Plain{model.name}({model.name}): __call__ = "
            f"{model.name}.__call__.__wrapped__` for a decorated __call__ (or pipeline "
            f"{model.name}(...) rather than nn.jit({model.name})(...)), and put transforms "
            "on the layers instead (the pipeline compiles the whole step anyway)"
        )
    levels = choose_levels(recorder.calls) | containers_above(recorder.calls, split_points)
    if levels != frozenset({()}):
        recorder, out_aval = record(levels)
    events = with_iterations(tuple(recorder.events))
    children = _event_paths(model, events)
    rec = Recorded(model, events, x_aval, param_avals, levels, children, out_aval)
    segments, dropped = clean_segments(rec)
    return _Traced(rec, segments, _units(param_avals, children), dropped)


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


def _refusal(traced: _Traced, stages: int) -> CutError:
    """Too few clean cut points for `stages`: say which there are and, for each cut
    that was dropped, what the code after it read from before it."""
    rec = traced.rec
    names = traced.names()
    scans = [
        f"{e.name} (nn.scan)"
        for e in rec.events
        if e.transform == "Scan" and e.kind == "call" and not e.iterations
    ]
    hints = []
    if traced.dropped:
        why = [
            f"{name} (the code after it reads {', '.join(_what(r) for r in reads)})"
            for name, reads in list(traced.dropped.items())[:6]
        ]
        hints.append(
            "cuts dropped because a later stage would read what an earlier one computed: "
            + "; ".join(why)
        )
    if scans:
        hints.append(
            f"{', '.join(scans)} runs its layers inside one scan that is not cut "
            "between iterations, because its per-iteration outputs (ys) are used or it "
            "runs in reverse: return None as the scan's per-iteration output and run it "
            "forwards, or use a Python loop over the layers (each may be nn.remat'd)"
        )
    calls = [e.name for e in rec.events if e.kind == "call"]
    if len(calls) < 2:
        hints.append(
            f"its forward pass makes {len(calls)} call(s) the cutter can cut between "
            f"({', '.join(calls) or 'none'}), and no repeated blocks were found below "
            "them: name the cut points with split_points=['path.to.block', ...]"
        )
    return CutError(
        f"stages: the model {rec.model.name} has {len(names)} clean cut "
        f"points ({', '.join(names) or 'none'}), too few for {stages} stages; use a "
        "model with more layers, add pjit_pipe.boundary() markers, or use fewer "
        "stages/chunks" + "".join(f"; {h}" for h in hints)
    )


def _what(read: str) -> str:
    return read if read == MODEL_INPUT else f"the output of {read}"


def _split_starts(traced: _Traced, split_points: Sequence[str], stages: int) -> list[int]:
    """The segment where each stage begins, from the event names of the cut points."""
    names = traced.names()
    points = list(split_points)
    if len(points) != stages - 1:
        raise CutError(
            f"split_points: {len(points)} cut points for {stages} stages; give "
            f"{stages - 1} (each stage but the first begins at one), from {names}"
        )
    starts = [0]
    for point in points:
        if point in traced.dropped:
            reads = ", ".join(_what(r) for r in traced.dropped[point])
            raise CutError(
                f"split_points: {point!r} is not a clean cut: the code after it reads "
                f"{reads}; choose among {names}"
            )
        if point not in names:
            raise CutError(
                f"split_points: unknown cut point {point!r} in {traced.rec.model.name}; "
                f"the candidate paths are {names}"
            )
        k = names.index(point) + 1
        if k <= starts[-1]:
            raise CutError(
                f"split_points: {point!r} comes before or at the previous cut point; "
                f"give them in the model's order, {names}"
            )
        starts.append(k)
    return starts


def cut_module(
    module: Any,
    variables: Any,
    x: Any,
    stages: int,
    balance: str = "flops",
    layers: Sequence[tuple[int, int]] | None = None,
    split_points: Sequence[str] | None = None,
) -> StageCut:
    """Cut `module` (linen or NNX, or its `Model` view) into `stages` stages for
    inputs shaped like `x` (one microbatch); `variables` are its parameters.
    `layers`: the stages as inclusive (first, last) ranges of the model's layers
    (its clean segments; a planner's `Plan.stages`) instead of balancing.
    `split_points`: the event names where stages 1, 2, ... begin ("model.layers.8";
    `StageCut.describe` and the refusals list them) instead of balancing."""
    if balance not in BALANCE:
        raise OptionError(f"balance: expected one of {', '.join(BALANCE)}, got {balance!r}")
    traced = _trace(module, variables, x, split_points or ())
    rec, segments, units = traced.rec, traced.segments, traced.units
    model, events, param_avals = rec.model, rec.events, rec.param_avals
    if split_points is not None:
        starts = _split_starts(traced, split_points, stages)
    elif len(segments) < stages:
        raise _refusal(traced, stages)
    sizes = {
        k: sum(math.prod(a.shape) for a in jax.tree.leaves(get_path(param_avals, path)))
        for k, path in units.items()
    }
    scan_share = scan_share_of(events, segments)  # a scan iteration weighs 1/L of its stack
    if balance == "flops" or layers is not None or split_points is not None:
        costs = [s.flops for s in segments]
    elif balance == "time":  # measured forward + backward of each segment
        from pjit_pipe.frontend.planning.measure import segment_times  # compiles: load on use

        one_each = traced.one_each()
        stage_params = one_each.split(model.variables(param_avals), _is_aval)
        costs = segment_times(one_each.stage_fns(), stage_params, rec.x_aval)
    else:
        costs = [
            float(sum(sizes[k] * scan_share[j].get(k, 1.0) for k in s.keys))
            for j, s in enumerate(segments)
        ]
        if balance == "flops+params":
            costs = [(s.flops, c) for s, c in zip(segments, costs, strict=True)]
    if layers is not None:
        starts = _check_layers(layers, len(segments), stages)
    elif split_points is None:
        starts = balance_costs(costs, stages)
    ends = [*starts[1:], len(segments)]
    groups = [segments[a:b] for a, b in zip(starts, ends, strict=True)]
    keys = [sorted(set().union(*(s.keys for s in g))) for g in groups]
    unused = sorted(set(units) - set().union(*map(set, keys)))
    keys[0] = sorted(keys[0] + unused)  # never read: they get zero gradients anywhere
    stage_costs = group_costs(costs, starts)  # with two measures: the worse share
    worst = max(stage_costs) if balance == "flops+params" else imbalance(stage_costs)
    if layers is None and split_points is None and worst > IMBALANCE_WARNING:
        warnings.warn(
            f"pipeline: the best cut of {model.name} into {stages} stages is imbalanced: "
            f"stage costs ({balance}) {[f'{c:.3g}' for c in stage_costs]}, the largest "
            f"{worst:.2f}x the mean; the pipeline runs at the pace of "
            "its slowest stage. Use fewer stages, or add pjit_pipe.boundary() markers "
            "to give the cutter finer cut points",
            stacklevel=2,
        )
    bounds = tuple(g[0].start for g in groups)
    keys, units, rows = split_stacks(events, bounds, keys, units)
    return traced.cut(starts, keys=tuple(tuple(k) for k in keys), units=units, rows=rows)
