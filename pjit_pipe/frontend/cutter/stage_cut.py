"""`StageCut`: a model cut into stages, and the split/merge of its parameters.

What `cut.py` finds (where the stages begin, which units each holds, what
crosses each cut), kept as one frozen value: it splits a module-layout
parameter tree into per-stage dicts and merges them back exactly, builds each
stage's function, describes itself, and checks that a loss reads none of the
model outputs its last stage leaves to earlier ones. See cut.py for how the
cut is chosen.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.errors import CutError
from pjit_pipe.frontend.cutter.adapters import Model, Path
from pjit_pipe.frontend.cutter.analysis import liveness
from pjit_pipe.frontend.cutter.events import Event
from pjit_pipe.frontend.cutter.stacks import Rows, rows_of, stack
from pjit_pipe.frontend.cutter.trace import Run


def _zeros(avals: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


def get_path(tree: Any, path: Path) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _assemble(parts: Mapping[Path, Any]) -> dict:
    """Nested dicts from (path -> subtree) parts."""
    out: dict = {}
    for path, sub in parts.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = sub
    return out


@dataclass(frozen=True)
class StaleOutput:
    """A model output that the last stage cannot compute: it reads what an earlier
    stage computed (a per-block cache a model returns beside its logits).

    Attributes:
        name: Where it sits in the model's output ("[1]['blocks.0'].rg_lru_state").
        producers: The calls before the last stage (or "the model input") it reads.
    """

    name: str
    producers: tuple[str, ...]


@dataclass(frozen=True)
class StageCut:
    """A module cut into `len(bounds)` stages.

    What the stage cutter found, kept as one frozen value: it splits the
    model's parameters into per-stage dicts and merges them back exactly,
    builds each stage's function and describes itself (`Pipelined.cut` returns
    it, `Pipelined.describe` shows it). A unit may be owned by several stages (tied weights,
    see `shared`).

    Attributes:
        model: The model, behind the cutter's adapter (linen or NNX).
        events: The top-level calls and boundary markers recorded from one
            forward pass, in order.
        bounds: bounds[s] is the event index where stage s begins (None for
            stage 0).
        keys: keys[s] names the parameter units stage s owns.
        flops: flops[s] is the estimated FLOPs of one microbatch's forward
            through stage s.
        x_aval: Shapes of the model input the cut was made with.
        param_avals: Shapes of the model's parameters.
        units: Unit name -> its path in the parameter tree.
        rows: rows[k], for a unit that holds some iterations of an nn.scan
            stack: the rows [first, stop) of its stacked parameters (its path
            is the whole stack's).
        levels: The module paths of the containers whose calls run as glue,
            the events being the calls inside them (() is the root).
        out_aval: Shapes of the model's output (None when not recorded).
        stale_outputs: The model outputs the last stage cannot compute; a loss
            must not read them (`check_loss`), and the last stage gives them as
            NaN (an integer type's least value, False).
    """

    model: Model
    events: tuple[Event, ...]
    bounds: tuple[int | None, ...]
    keys: tuple[tuple[str, ...], ...]
    flops: tuple[float, ...]
    x_aval: Any
    param_avals: dict
    units: dict[str, Path]
    rows: Mapping[str, Rows] = dataclasses.field(default_factory=dict)
    levels: frozenset[tuple[str, ...]] = frozenset({()})
    out_aval: Any = None
    stale_outputs: tuple[StaleOutput, ...] = ()

    def _unit(self, tree: Any, k: str, is_leaf: Callable[[Any], bool] | None = None) -> Any:
        """Unit k's subtree of a whole-model tree (its rows, for part of a scan stack)."""
        return rows_of(get_path(tree, self.units[k]), self.rows.get(k), is_leaf)

    @property
    def stages(self) -> int:
        """How many stages the model is cut into.

        Returns:
            len(bounds).
        """
        return len(self.bounds)

    def stage_names(self, s: int) -> list[str]:
        """Names of the events stage s runs (for reports and errors).

        Args:
            s: A stage, 0 <= s < stages.

        Returns:
            The event names; a cut nn.scan stack's first iteration as "name[0]".
        """
        stop = self.bounds[s + 1] if s + 1 < self.stages else len(self.events)
        events = self.events[self.bounds[s] or 0 : stop]
        return [f"{e.name}[0]" if e.iterations else e.name for e in events]

    def stage_fn(self, s: int) -> Callable[[Any, Any], Any]:
        """The model's code from cut s to cut s+1, as a function of its own parameters.

        Other stages' parameters and skipped calls are zero stand-ins that only
        dead code reads (checked when the cut was made).

        Args:
            s: A stage, 0 <= s < stages.

        Returns:
            stage_fn(params_s, act) -> act, with params_s one dict of `split`.
        """
        start = self.bounds[s]
        stop = self.bounds[s + 1] if s + 1 < self.stages else None
        held = {self.units[k] for k in self.keys[s]}
        others = {
            path: get_path(self.param_avals, path)
            for path in set(self.units.values()) - held  # whole stacks, even if split
        }
        calls_before = [i for i in range(start or 0) if self.events[i].kind == "call"]

        def stage(params_s: Any, act: Any) -> Any:
            # Other stages' parameters and skipped calls are zero stand-ins that
            # only dead code reads (checked when the cut was made).
            own = {self.units[k]: v for k, v in params_s.items()}
            params = _assemble({**_zeros(others), **own})
            if start is None:
                run = Run(stop=stop, expected=self.events, levels=self.levels)
                return self.model.run(params, act, run)
            skips = {i: _zeros(self.events[i].out) for i in calls_before}
            run = Run(start, stop, act, skips, self.events, self.levels)
            out = self.model.run(params, _zeros(self.x_aval), run)
            return _blanked(out, self.stale_outputs) if stop is None else out

        stage.__name__ = f"stage_{s}"
        return stage

    @property
    def shared(self) -> dict[str, tuple[int, ...]]:
        """Units held by more than one stage (tied weights).

        Returns:
            Unit name -> the stages holding it, for each such unit.
        """
        holders: dict[str, list[int]] = {}
        for s, keys in enumerate(self.keys):
            for k in keys:
                holders.setdefault(k, []).append(s)
        return {k: tuple(v) for k, v in sorted(holders.items()) if len(v) > 1}

    def param_bytes(self, s: int) -> int:
        """Bytes of the parameters stage s holds.

        Args:
            s: A stage, 0 <= s < stages.

        Returns:
            The byte count (a shared unit counts in each holder).
        """
        return sum(
            math.prod(a.shape) * a.dtype.itemsize
            for k in self.keys[s]
            for a in jax.tree.leaves(self._unit(self.param_avals, k))
        )

    def describe(self) -> str:
        """The cut as a table, for people.

        Returns:
            Per stage its calls, parameter bytes, estimated forward FLOPs per
            microbatch and the shapes of the input it receives; then the shared
            units and the imbalance (largest / mean cost).
        """
        lines = [f"{self.model.name} cut into {self.stages} stages"]
        for s in range(self.stages):
            start = self.bounds[s]
            given = "model input" if start is None else _shapes(self.events[start].act)
            at = "" if start is None else f" (cut before {self.events[start].name})"
            lines.append(
                f"  stage {s}{at}: {', '.join(self.stage_names(s)) or '(glue only)'}\n"
                f"    params {self.param_bytes(s):,} B, {self.flops[s]:.3g} FLOPs, in: {given}"
            )
        for k, holders in self.shared.items():
            lines.append(f"  shared {k}: held by stages {', '.join(map(str, holders))}")
        if self.stale_outputs:
            names = [out.name for out in self.stale_outputs]
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            producers = dict.fromkeys(p for out in self.stale_outputs for p in out.producers)
            lines.append(
                f"  outputs the last stage cannot compute (from {', '.join(producers)}; the "
                f"loss must not read them): {shown}"
            )
        lines.append(f"  imbalance (largest / mean cost): {imbalance(self.flops):.2f}x")
        return "\n".join(lines)

    def check_loss(self, loss_fn: Callable[..., Any], y: Any) -> None:
        """Refuse a loss that reads a model output the last stage cannot compute.

        Args:
            loss_fn: `loss_fn(outputs, y)`, as the pipeline calls it per microbatch.
            y: The targets of a global batch (or of one microbatch).

        Raises:
            CutError: The loss (or its aux) reads one of `stale_outputs`, named with
                the calls it comes from.
        """
        if not self.stale_outputs:
            return
        rows = jax.tree.leaves(self.x_aval)[0].shape[0]
        y_aval = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype), y)
        closed = jax.make_jaxpr(loss_fn)(self.out_aval, y_aval)
        used = liveness(closed.jaxpr).used
        names = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(self.out_aval)[0]
        ]
        read = {n for n, u in zip(names, used, strict=False) if u}
        bad = [out for out in self.stale_outputs if out.name in read]
        if bad:
            outs = "; ".join(f"{o.name} (from {', '.join(o.producers)})" for o in bad)
            first = self.events[self.bounds[-1]].name
            raise CutError(
                f"loss_fn: it reads outputs of {self.model.name} that come from before the "
                f"last stage's cut at {first}, which no stage hands on: {outs}; read only "
                "the outputs the last stage computes (the logits), have the model not "
                "return the others, or cut so that their blocks run in the last stage "
                "(split_points)"
            )

    def stage_fns(self) -> list[Callable[[Any, Any], Any]]:
        """Every stage's function, the same objects on every call (programs of one
        cut, such as its failure variants, then share their traced stages).

        Returns:
            [stage_fn(s) for each stage s].
        """
        return list(self._stage_fns)

    @functools.cached_property
    def _stage_fns(self) -> tuple[Callable[[Any, Any], Any], ...]:
        return tuple(self.stage_fn(s) for s in range(self.stages))

    def split(self, variables: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[dict]:
        """The model's parameters -> one dict of units per stage.

        Args:
            variables: The model's parameters as its users hold them, or a tree
                shaped like them with `is_leaf` nodes for leaves.
            is_leaf: Marks the leaves of such a tree (e.g. ShapeDtypeStructs).

        Returns:
            Per stage, unit name -> its subtree (its rows, for part of a scan
            stack).

        Raises:
            CutError: The tree differs from the one the model was cut with.
        """
        params = self.model.params(variables)
        if jax.tree.structure(params, is_leaf) != jax.tree.structure(self.param_avals):
            raise CutError(
                f"params: their tree {jax.tree.structure(params)} differs from the one the "
                f"model was cut with {jax.tree.structure(self.param_avals)}"
            )
        return [{k: self._unit(params, k, is_leaf) for k in keys} for keys in self.keys]

    def merge(self, stage_trees: Sequence[Any]) -> Any:
        """Inverse of `split`: per-stage dicts (parameters or gradients) -> the model's form.

        A shared unit is taken from its first holder (the lowering keeps the
        holders' copies equal, and gives each the summed gradient); the row
        blocks of a split scan stack are concatenated.

        Args:
            stage_trees: One dict of units per stage, as `split` gives.

        Returns:
            The tree in the model's own form (as its users hold parameters).

        Raises:
            CutError: There are not `stages` trees.
        """
        if len(stage_trees) != self.stages:
            raise CutError(f"merge: expected {self.stages} stage trees, got {len(stage_trees)}")
        parts: dict[Path, Any] = {}
        blocks: dict[Path, list[tuple[int, Any]]] = {}
        for tree in stage_trees:
            for k, v in tree.items():
                if k in self.rows:
                    blocks.setdefault(self.units[k], []).append((self.rows[k][0], v))
                else:
                    parts.setdefault(self.units[k], v)
        for path, row_blocks in blocks.items():
            parts[path] = stack([v for _, v in sorted(row_blocks, key=lambda b: b[0])])
        return self.model.variables(_assemble(parts))


def _blanked(out: Any, stale: Sequence[StaleOutput]) -> Any:
    """The model output with the leaves the last stage cannot compute (made from
    stand-ins) replaced by NaN, or the least value of an integer or boolean type:
    a forward pass shows them as missing rather than as numbers."""
    if not stale:
        return out
    names = {o.name for o in stale}

    def blank(path: Any, leaf: Any) -> Any:
        if jax.tree_util.keystr(path) not in names:
            return leaf
        dtype = jnp.result_type(leaf)
        if dtype == jnp.bool_:
            fill = False
        elif jnp.issubdtype(dtype, jnp.inexact):
            fill = jnp.nan
        else:
            fill = jnp.iinfo(dtype).min
        return jnp.full(jnp.shape(leaf), fill, dtype)

    return jax.tree_util.tree_map_with_path(blank, out)


def _shapes(avals: Any) -> str:
    return ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in avals)


def imbalance(costs: Sequence[float]) -> float:
    """Largest stage cost over the mean: the slowdown against a perfect split."""
    mean = sum(costs) / len(costs)
    return max(costs) / mean if mean > 0 else 1.0
