"""The exact planner for small instances: exhaustive search with a proven bound.

It enumerates every shape D x P (as the fast search does), every contiguous
partition into P stages, every placement of D*P distinct devices (replicas
are interchangeable, so only placements whose rows start with increasing
device ids are tried) and every schedule kind, and prices each plan that fits
memory with the same event simulation. A plan is skipped without simulating
only when a lower bound already rules it out: no worker can finish its m
microbatches and its OPT faster than its own busy time, so
    period >= max over workers of (m * stage work / device speed + all-reduce).
The minimum it returns is therefore the optimum of the cost model
(`pjit_pipe.planner.cost`), for the objective period / D of the fast search.
The count of plans grows as C(L-1, P-1) * N! / (N-DP)!: keep to about 8
layers and 4 devices.
"""

from __future__ import annotations

import itertools

import numpy as np

from pjit_pipe.planner.cost import PLANNABLE_KINDS, CostModel, Evaluation, Plan, PlanError
from pjit_pipe.planner.search import placements, shapes


def exact_plan(
    model: CostModel,
    stages: int | None = None,
    replicas: int | None = None,
    schedule: str | None = None,
) -> tuple[Evaluation, int]:
    """(the optimal plan, how many plans were simulated); PlanError if none fits."""
    n_layers, n_dev, m = len(model.profile), len(model.devices), model.microbatches
    kinds = [schedule] if schedule else list(PLANNABLE_KINDS)
    work = np.concatenate([[0.0], np.cumsum(model.profile.work)])
    params = np.concatenate([[0.0], np.cumsum(model.profile.param_bytes)])
    best: Evaluation | None = None
    best_obj = float("inf")
    simulated = 0
    for D, P in shapes(n_dev, n_layers, stages, replicas):
        for cuts in itertools.combinations(range(1, n_layers), P - 1):
            bounds = np.array((0, *cuts, n_layers))
            stage_work = work[bounds[1:]] - work[bounds[:-1]]
            stage_params = params[bounds[1:]] - params[bounds[:-1]]
            for mapping in placements(n_dev, D, P):
                cols = np.array(mapping)
                busy = m * stage_work[None, :] / model.devices.speed[cols]
                bound = (busy + model.allreduce(cols, stage_params)[None, :]).max() / D
                if bound >= best_obj:
                    continue
                for kind in kinds:
                    plan = Plan.from_cuts(cuts, n_layers, mapping, kind)
                    if not model.fits(plan):
                        continue
                    ev = model.evaluate(plan, iterations=1)
                    simulated += 1
                    if ev.period / D < best_obj * (1 - 1e-12):
                        best, best_obj = ev, ev.period / D
    if best is None:
        raise PlanError("no plan fits in memory")
    return model.evaluate(best.plan), simulated
