"""Run a stage's backward fused again where splitting it buys no time.

Splitting BW into B and W (`split_backward`) lets later passes move W into
bubbles; zero-bubble schedules split every stage. The split is not free on
real models: a split stage's F also stores what its W reads (a dense layer's
input), B writes the cotangents W reads back, and B and W are two programs
where BW is one. Measured costs say by how much (`Costs.f_fused`, `Costs.bw`:
the F and BW of a stage the schedule does not split). Where a stage's Ws fill
no bubble, for instance on a stage that holds most of the work and so never
waits, the split only costs: its W could run right after its B, and then the
stage may as well run fused.

`fuse_where_free` therefore tries, stage by stage, to put every W of a stage
back right after its B and merge the pair into BW, and keeps the change only
where the event-driven steady period under the given costs gets strictly
shorter. With no fused prices (`f_fused` and `bw` None: F and BW cost what F
and B + W do, as under the CLI's unit costs) no change is ever shorter, so
the schedule comes back as it was. The result is valid whenever the input
is: a W depends on its own B only and nothing waits on a W but OPT, which
stays after it; moving a W earlier only frees memory earlier.
"""

from __future__ import annotations

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind, Op
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.simulator import STEADY_ITERATIONS, steady_period


def fuse_stage(schedule: Schedule, stage: int) -> Schedule:
    """Every W of virtual stage `stage` moved to right after its B, the pair run as
    one BW (on the worker that runs both: the validator keeps them together)."""
    programs = {}
    for worker, program in schedule.programs.items():
        out: list[Op] = []
        for op in program:
            if op.stage == stage and op.kind is Kind.W:
                continue  # runs inside the BW that replaces its B
            out.append(op._replace(kind=Kind.BW) if op.stage == stage and op.kind is Kind.B else op)
        programs[worker] = out
    return schedule.replace(programs=programs)


def fuse_where_free(
    schedule: Schedule, costs: Costs, iterations: int = STEADY_ITERATIONS
) -> Schedule:
    """`schedule` with the backward of each stage whose split costs time fused again.

    Stages are tried in order of what fusing saves per microbatch (the largest
    first); a stage is fused when the steady period over `iterations` iterations
    gets strictly shorter. The kind gains "+fused" when any stage was fused.
    """
    split = sorted({op.stage for _, _, op in schedule.ops() if op.kind in (Kind.B, Kind.W)})
    if not split or (costs.f_fused is None and costs.bw is None):
        return schedule
    table = costs.per_stage(schedule.stages)
    fused = costs.fused_per_stage(schedule.stages)

    def saving(stage: int) -> float:
        (f, b, w), (f_fused, bw) = table[schedule.layout[stage]], fused[schedule.layout[stage]]
        return (f + b + w) - (f_fused + bw)

    best, best_period = schedule, steady_period(schedule, costs, iterations)
    for stage in sorted(split, key=saving, reverse=True):
        if saving(stage) <= 0:
            break
        candidate = fuse_stage(best, stage)
        period = steady_period(candidate, costs, iterations)
        if period < best_period * (1 - 1e-9):
            best, best_period = candidate, period
    if best is schedule:
        return schedule
    return best.replace(kind=f"{schedule.kind}+fused")
