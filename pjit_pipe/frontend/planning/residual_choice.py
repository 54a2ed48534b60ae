"""A residual policy per stage, chosen by measurement (`remat="auto"`).

A stage whose backward runs in a program of its own (every stage but an
unsplit loss stage fused with its F) stores F's vjp residuals in a pool row
and reads them back. What that costs against one fused `jax.vjp` program
depends on which residuals F keeps, and differently per device: on one H200
a GPT-2 block stage's split F+B+W cost 1.17-1.26x its fused vjp under
`dots_saveable` and 1.23-1.40x with every residual kept, while the CPU
barely shows a difference. No rule picks the policy for every stage and
device, so `choose_stage_policies` times each virtual stage's ops as the
lowering runs them (F, B and W of a split stage, F and BW of any other: the
`measure.py` ops) under every candidate of `lowering.POLICIES`, on the device
that holds the stage, and keeps the fastest that fits the memory limit.

The memory limit: a policy fits a stage when, for each residual pool (the
B-pool and the W-pool, stages.py) and dtype, the stage's row under it is no
longer than the row that pool has under the default policy. One SPMD program
sizes every device's pool rows by the widest stage, so a chosen policy never
grows the program's residual memory over what `remat=False` holds; a stage
narrower than the widest may keep more, up to that width. The default
policy always fits, so every stage gets a policy.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjit_pipe.frontend.planning.measure import median_seconds
from pjit_pipe.frontend.planning.stage_programs import stage_programs
from pjit_pipe.lowering import (
    DEFAULT_POLICY,
    POLICIES,
    FlatSpec,
    LossLayout,
    StageVjp,
    dtype_of,
    saved_names,
)

RowElements = dict[tuple[str, str], int]  # (pool "b" or "w", dtype) -> elements


@dataclass(frozen=True)
class PolicyChoice:
    """One virtual stage's residual policy and what was measured for every candidate.

    `seconds[p]`: the median seconds of one microbatch's F+B+W (a split stage) or
    F+BW under policy p; `nbytes[p]`: the bytes the stage stores per microbatch
    under p (both pools); `fits[p]`: whether p is within the memory limit (the
    module docstring); `policy`: the fastest policy that fits.
    """

    policy: str
    split: bool
    seconds: dict[str, float]
    nbytes: dict[str, int]
    fits: dict[str, bool]

    def describe(self) -> str:
        """One line: the choice, then each candidate's time over the default's and bytes.

        Returns:
            e.g. "dots (F+B+W 1.234 ms); all 1.05x 2.1 MB, ..." (">limit": over the
            memory limit).
        """
        base = self.seconds[DEFAULT_POLICY]
        ops = "F+B+W" if self.split else "F+BW"
        parts = [
            f"{p} {self.seconds[p] / base:.2f}x {self.nbytes[p] / 1e6:.3g} MB"
            + ("" if self.fits[p] else " >limit")
            for p in self.seconds
        ]
        return f"{self.policy} ({ops} {1e3 * self.seconds[self.policy]:.3f} ms); " + ", ".join(
            parts
        )


def choose_policy(seconds: dict[str, float], fits: dict[str, bool]) -> str:
    """The fastest policy among those that fit (ties: the earlier in `POLICIES`).

    Args:
        seconds: measured seconds per candidate policy.
        fits: per candidate, whether it is within the memory limit.

    Returns:
        The chosen policy; the default one if none fits.
    """
    fitting = [p for p in seconds if fits[p]]
    if not fitting:
        return DEFAULT_POLICY
    return min(fitting, key=lambda p: (seconds[p], POLICIES.index(p)))


def row_elements(stages: StageVjp, s: int) -> RowElements:
    """Elements of stage s's stored rows per (pool, dtype) under `stages`' policy.

    Args:
        stages: the stages, compiled under some residual policies.
        s: the virtual stage.

    Returns:
        {("b" or "w", dtype name): elements}.
    """
    return _per_dtype(
        (pool, key, n) for pool, spec in _pools(stages) for key, _, n in spec.slots[s]
    )


def pool_rows(stages: StageVjp) -> RowElements:
    """The width of every pool row per (pool, dtype): what each device holds a row
    of (a row in size classes: the sum of its classes)."""
    return _per_dtype(
        (pool, key, n) for pool, spec in _pools(stages) for key, n in spec.sizes.items()
    )


def _pools(stages: StageVjp) -> tuple[tuple[str, FlatSpec], ...]:
    return ("b", stages.b_spec), ("w", stages.w_spec)


def _per_dtype(elements: Iterable[tuple[str, str, int]]) -> RowElements:
    """(pool, buffer key, elements) summed per (pool, dtype): a row's flat part and
    its size classes count alike."""
    got: RowElements = {}
    for pool, key, n in elements:
        got[pool, dtype_of(key)] = got.get((pool, dtype_of(key)), 0) + n
    return got


def _nbytes(elements: RowElements) -> int:
    return sum(n * np.dtype(key).itemsize for (_, key), n in elements.items())


def time_ops(ops: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each op (`measure.median_seconds`, round robin); the
    seam a test replaces to choose from given times."""
    return median_seconds(ops, repeats)


def candidates(stages: StageVjp, s: int) -> list[str]:
    """The policies worth timing on stage s: all of `POLICIES`, "names" only
    where the stage marks names with `checkpoint_name`."""
    names = saved_names(stages.fns[s], stages.param_avals[s], stages.act_avals[s])
    return [p for p in POLICIES if p != "names" or names]


_CACHE: dict[Any, tuple[Any, tuple[PolicyChoice, ...]]] = {}


def choose_stage_policies(
    stage_fns: Sequence[Callable],
    loss_fn: Callable,
    stage_params: Sequence[Any],
    x_mb: Any,
    y_mb: Any,
    mesh: Mesh,
    split: Collection[int],
    key: Any = None,
    repeats: int = 5,
) -> tuple[PolicyChoice, ...]:
    """Time every virtual stage under every candidate policy and choose one each.

    Args:
        stage_fns: the virtual stages' functions.
        loss_fn: the microbatch loss (as `lower` takes it).
        stage_params: per stage, its parameters (arrays or ShapeDtypeStructs).
        x_mb: one microbatch's inputs (shapes).
        y_mb: one microbatch's targets (shapes).
        mesh: the (data, stage) pipeline mesh; stage s is timed on its device.
        split: the stages the schedule runs as separate B and W
            (`ir.memory.split_stages`).
        key: hashable (model, loss, shapes): the result is cached per (key,
            devices, split); None: not cached.
        repeats: timed calls per op (medians).

    Returns:
        One `PolicyChoice` per virtual stage.
    """
    devices = tuple(d.id for d in np.asarray(mesh.devices).flat)
    full_key = None if key is None else (key, devices, tuple(sorted(split)), len(stage_fns))
    if full_key in _CACHE:
        return _CACHE[full_key][1]
    S, positions = len(stage_fns), mesh.shape["stage"]
    avals = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), stage_params
    )
    loss = LossLayout(loss_fn).vector
    build = lambda policy: StageVjp(  # noqa: E731
        stage_fns, loss, avals, x_mb, y_mb, split, policies=(policy,) * S
    )
    default = build(DEFAULT_POLICY)
    limit = pool_rows(default)
    tried = {p: default if p == DEFAULT_POLICY else build(p) for p in POLICIES}
    row = np.asarray(mesh.devices)[0]
    choices = []
    for s in range(S):
        names = candidates(default, s)
        ops = {}
        for p in names:
            for op, fn in stage_programs(tried[p], s, row[s % positions], y_mb).items():
                if op != "FBW":  # the loss stage's fused program stores nothing
                    ops[f"{p} {op}"] = fn
        times = time_ops(ops, repeats)
        seconds = {p: sum(t for k, t in times.items() if k.split(" ")[0] == p) for p in names}
        rows = {p: row_elements(tried[p], s) for p in names}
        fits = {p: all(n <= limit.get(k, 0) for k, n in rows[p].items()) for p in names}
        choices.append(
            PolicyChoice(
                policy=choose_policy(seconds, fits),
                split=s in default.split,
                seconds=seconds,
                nbytes={p: _nbytes(rows[p]) for p in names},
                fits=fits,
            )
        )
    result = tuple(choices)
    if full_key is not None:
        _CACHE[full_key] = (stage_fns, result)  # keeps the functions (and key ids) alive
    return result
