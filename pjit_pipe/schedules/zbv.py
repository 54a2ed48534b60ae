"""ZB-V: two chunks per position in a V (`v_layout`), B/W split, 1F1B's memory.

Position p holds stages p and 2P-1-p, so a microbatch's last forward and first
backward meet on position 0 and the start-up bubble nearly vanishes. The op
order is the best the greedy engine finds on this layout for the given costs
under the memory limit P (by makespan, then span); `auto` with chunks=2 also
tries other limits, layouts and warm-up caps. At unit costs and P=4, m=8:
span 24 = m(F+B+W), makespan 25.5, peak memory <= P.
"""

from __future__ import annotations

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.schedule import Schedule, v_layout
from pjit_pipe.schedules.common import check_positive, replicated
from pjit_pipe.schedules.heuristic import Policy, greedy
from pjit_pipe.schedules.timing import Shape, to_ops

# Without reservation the order is tighter; with it, it is guaranteed to exist.
_POLICIES = tuple(
    Policy(None, fill, reserve) for reserve in (False, True) for fill in ("eager", "fit")
)


def zb_v(stages: int, microbatches: int, replicas: int = 1, costs: Costs | None = None) -> Schedule:
    """The V-shaped zero-bubble schedule (peak memory <= P on every position)."""
    check_positive(stages=stages, microbatches=microbatches, replicas=replicas)
    shape = Shape.of(stages, 2, microbatches, v_layout(stages), costs or Costs())
    plans = [plan for policy in _POLICIES if (plan := greedy(shape, stages, policy))]
    best = min(plans, key=lambda plan: plan.timing.score("makespan"))
    return replicated(
        "zb-v",
        stages,
        microbatches,
        replicas,
        lambda p, r: to_ops(best.programs[p], r),
        chunks=2,
        layout=v_layout(stages),
    )
