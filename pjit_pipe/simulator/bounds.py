"""Work-conserving bounds: what no schedule can beat under a failure pattern.

`lower_bound` is what re-routed schedules are measured against (tests,
benchmarks) and where the failure-aware search stops early.
"""

from __future__ import annotations

from collections.abc import Iterable

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def lower_bound(
    stages: int,
    microbatches: int,
    replicas: int,
    failed: FailurePattern | Iterable[tuple[int, int]] = (),
    costs: Costs | None = None,
    chunks: int = 1,
) -> float:
    """Work-conserving bound on the steady iteration period.

    The larger of the fault-free bound and the load of the busiest surviving
    worker: a stage with k failed replicas spreads its D*m microbatches over
    D-k workers, one of which gets ceil(D*m/(D-k)) whole microbatches (plus
    the optimizer steps of its `chunks` chunks). The fault-free bound is the
    larger of the ideal m*(F+B+W) and one microbatch's round trip: stage 0
    cannot start an iteration before its optimizer has the previous one's
    gradients, which need every stage's F and B of one microbatch (and at
    least 2(P-1) transfers) and its own W.
    """
    costs = costs or Costs()
    pattern = FailurePattern.of(replicas, stages, failed)
    per_stage = costs.per_stage(stages)
    total = replicas * microbatches
    steps = chunks * costs.opt
    round_trip = sum(f + b for f, b, _ in per_stage) + per_stage[0][2] / chunks
    round_trip += 2 * (stages - 1) * costs.c + costs.opt
    busiest = max(
        _ceil_div(total, len(pattern.survivors(p))) * sum(per_stage[p]) for p in range(stages)
    )
    return max(round_trip, busiest + steps)
