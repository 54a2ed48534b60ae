"""ZB-V: two chunks per position in a V (`v_layout`), B/W split, 1F1B's memory.

Position p holds stages p and 2P-1-p, so a microbatch's last forward and first
backward meet on position 0 and the start-up bubble nearly vanishes. The op
order is the one the greedy engine finds for equal F, B and W and free
communication under the memory limit P, as the hand-made ZB-V was designed for
F = B = W; it does not depend on the costs it is later priced with (use
`auto` with chunks=2 for a cost-aware V schedule). At unit costs and P=4, m=8:
span 24 = m(F+B+W), makespan 25.5, peak memory <= P.
"""

from __future__ import annotations

from pjit_pipe.ir.schedule import Schedule, v_layout
from pjit_pipe.schedules.common import check_positive, replicated
from pjit_pipe.schedules.heuristic import Policy, greedy
from pjit_pipe.schedules.timing import Shape, to_ops
from pjit_pipe.simulator.costs import Costs

# Without reservation the order is tighter; with it, it is guaranteed to exist.
_POLICIES = (Policy(None, "eager", reserve=False), Policy(None, "eager", reserve=True))


def zb_v(stages: int, microbatches: int, replicas: int = 1) -> Schedule:
    """The V-shaped zero-bubble schedule (peak memory <= P on every position)."""
    check_positive(stages=stages, microbatches=microbatches, replicas=replicas)
    shape = Shape.of(stages, 2, microbatches, v_layout(stages), Costs())
    plans = [plan for policy in _POLICIES if (plan := greedy(shape, stages, policy))]
    best = min(plans, key=lambda plan: plan.timing.score("span"))
    return replicated(
        "zb-v",
        stages,
        microbatches,
        replicas,
        lambda p, r: to_ops(best.programs[p], r),
        chunks=2,
        layout=v_layout(stages),
    )
