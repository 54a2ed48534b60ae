"""Schedule request -> schedule -> passes -> tick table -> program, in one place.

The steps, each a function so that callers that stop early (the planner prices
schedules, `pjit-pipe schedule` prices tables) share the same code:

    build_schedule(spec, costs)       the generator (or search) for spec.kind, the
                                      optimizer-stagger pass, validation
    build_table(schedule, costs, ...) the tick table the lowering compiles
    build_program(table, ...)         the compiled SPMD program (`lowering.lower`)

Costs are given once, to both the schedule and the table: the same cost model
steers the schedule search and packs its ticks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule, ScheduleError, interleaved_layout, v_layout
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import DEFAULT_CHUNKS, make_schedule
from pjit_pipe.tick_packing import pack_ticks

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from pjit_pipe.lowering import LoweringOptions, PipelineStep


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule is built from, apart from its costs.

    kind: one of `pjit_pipe.schedules.KINDS`.
    stages, microbatches, replicas: P, m (per replica) and D.
    chunks: chunks per device (None: the kind's own, `DEFAULT_CHUNKS`).
    failed: (replica, stage) workers that are down: their microbatches are
        re-routed to peers of the same stage (the failure-aware search).
    mem_limit: each worker's in-flight activation bound (units of docs/design.md
        section 3); None: the kind's own.
    stagger: each stage steps its optimizer as soon as its own gradients are done.
    search_time: seconds the failure-aware search may take.
    stagger_reroutes: keep the re-routed schedule's staggered optimizer (the
        failure-aware search staggers it); False: every stage steps after the
        iteration's last op, as in the fault-free kinds.
    exact_time_limit: seconds auto may hand its best schedule to the exact engine.
    slow: {(replica, stage): factor >= 1}: slow workers, part of whose
        microbatch-slices the failure-aware search moves to peers (ir/slow.py).
    """

    kind: str
    stages: int
    microbatches: int
    chunks: int | None = None
    replicas: int = 1
    failed: FailurePattern | Iterable[tuple[int, int]] = ()
    mem_limit: float | None = None
    stagger: bool = False
    search_time: float = 10.0
    exact_time_limit: float | None = None
    slow: Mapping[tuple[int, int], float] | None = None
    stagger_reroutes: bool = True


def chunks_of(kind: str, chunks: int | None) -> int:
    """The chunks per device a schedule of `kind` will have, before it is built
    (cutting the model needs the number of virtual stages first)."""
    return DEFAULT_CHUNKS[kind] if chunks is None else chunks


def layout_of(kind: str, stages: int, chunks: int) -> tuple[int, ...]:
    """Which position holds each virtual stage, before the schedule is built: measured
    per-stage costs are summed per position under it. The V for zb-v and for auto's
    two-chunk search (which tries the V first), the interleaved order otherwise."""
    if chunks == 2 and kind in ("zb-v", "auto"):
        return v_layout(stages)
    return interleaved_layout(stages, chunks)


def build_schedule(spec: ScheduleSpec, costs: Costs | None = None) -> Schedule:
    """The validated schedule of `spec` under `costs` (None: the kind's defaults).

    Raises:
        ScheduleError: naming the parameter, when no schedule of spec.kind meets
            spec (its chunks, its memory limit, a stage with no survivor).
    """
    schedule = make_schedule(
        spec.kind,
        spec.stages,
        spec.microbatches,
        spec.chunks,
        costs,
        spec.mem_limit,
        spec.replicas,
        exact_time_limit=spec.exact_time_limit,
        failed=spec.failed,
        search_time=spec.search_time,
        slow=spec.slow,
    )
    if spec.stagger:
        schedule = stagger(schedule)
    elif not spec.stagger_reroutes and schedule.staggered and not schedule.asynchronous:
        # Each worker's op order is one valid iteration either way; unstaggered,
        # the iteration ends with every stage's optimizer step.
        schedule = schedule.replace(staggered=False)
    validate(schedule)
    if spec.mem_limit is not None:
        try:
            validate(schedule, mem_limit=spec.mem_limit)
        except ScheduleError as e:
            raise ScheduleError(f"mem_limit {spec.mem_limit:g} is too small: {e}") from None
    return schedule


def build_table(
    schedule: Schedule,
    costs: Costs | None = None,
    iterations: int = 1,
    mem_limit: float | None = None,
    polish: float = 0.0,
    sync: str = "global",
) -> PackedTicks:
    """The tick table the lowering compiles for `iterations` iterations of
    `schedule`, packed for `costs` (None: unit costs) within `mem_limit` (None: the
    schedule's own peak), polished `polish` seconds a window, for the price of
    the runtime's tick synchronization `sync` ("global" or "neighbor"; see
    `pack_ticks` and simulator/tick_sync.py)."""
    return pack_ticks(schedule, costs or Costs(), iterations, mem_limit, polish=polish, sync=sync)


def build_program(
    table: PackedTicks,
    stage_fns: Sequence[Callable],
    loss_fn: Callable,
    mesh: Mesh,
    stage_params: Sequence[Any],
    x: Any,
    y: Any,
    options: LoweringOptions | None = None,
) -> PipelineStep:
    """The compiled program that runs `table` for these stages (`lowering.lower`).
    The lowering is loaded on first use: pricing schedules never needs it."""
    from pjit_pipe.lowering import lower

    return lower(table, stage_fns, loss_fn, mesh, stage_params, x, y, options)
