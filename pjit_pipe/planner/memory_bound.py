"""The least memory a device must hold for some plan to fit: what an infeasible
memory budget's error names, so the user knows how far off the budget is."""

from __future__ import annotations

import numpy as np

from pjit_pipe.planner.cost import CostModel, peak_inflight
from pjit_pipe.planner.partition import Partitioner
from pjit_pipe.planner.search import shapes


def smallest_memory(
    model: CostModel, stages: int | None, replicas: int | None, kinds: list[str]
) -> tuple[float, int, str]:
    """(bytes, P, kind): the least memory a device must hold for some plan to fit.

    Over every allowed P and kind, a min-max DP finds the partition whose fullest
    position needs the least (STATE_COPIES x parameters + peak in-flight
    activations); the mapping does not change what a position needs.
    """
    part = Partitioner(model, model.microbatches)
    n = part.n
    best = (float("inf"), 0, "")
    for _, P in {(1, p) for _, p in shapes(len(model.devices), n, stages, replicas)}:
        for kind in kinds:
            peaks = peak_inflight(kind, P, model.microbatches)
            need = [np.where(part.valid, part.state + peak * part.act, np.inf) for peak in peaks]
            g = need[0][0]
            for p in range(1, P):
                g = np.min(np.maximum(g[:, None], need[p]), axis=0)
            if g[n] < best[0]:
                best = (float(g[n]), P, kind)
    return best
