"""ZB-H1 and ZB-H2: 1F1B with the backward split into B and W, and W postponed.

Both follow one pattern per position p: `warmup(p)` forwards, then for each
microbatch k its B, the W postponed by `defer(p)` microbatches (W of k -
defer(p)), and the next forward; the postponed W's close the program. W only
updates this stage's parameters, so postponing it lets the gradient reach the
previous stage sooner: the start-up bubble shrinks from (P-1)(F+B+W) to
(P-1)(F+B-W) (ZB-H1) or is filled with extra forwards (ZB-H2).

  zb-h1: warmup P-p, defer p. Peak memory P - p/2 on position p (<= P, as 1F1B);
         makespan m(F+B+W) + (P-1)(F+B-W) at C=0, m >= P
         and W <= min(F, B).
  zb-h2: warmup 2(P-p)-1, defer 2p. Peak memory 2P-1-p (<= 2P);
         at unit costs and m >= 2P-1, every worker is busy from its first op
         to its last: span m(F+B+W).
"""

from __future__ import annotations

from collections.abc import Callable

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.schedules.common import check_positive, replicated
from pjit_pipe.schedules.timing import Step, to_ops


def split_program(position: int, microbatches: int, warmup: int, defer: int) -> list[Step]:
    """One position's program: `warmup` F, then B(k), W(k - defer), F(k + warmup) per k."""
    m, p = microbatches, position
    warmup = min(warmup, m)
    steps = [Step(Kind.F, p, j) for j in range(warmup)]
    done_w = 0
    for k in range(m):
        steps.append(Step(Kind.B, p, k))
        while done_w <= k - defer:
            steps.append(Step(Kind.W, p, done_w))
            done_w += 1
        if k + warmup < m:
            steps.append(Step(Kind.F, p, k + warmup))
    return steps + [Step(Kind.W, p, j) for j in range(done_w, m)]


def _split_schedule(
    kind: str,
    stages: int,
    microbatches: int,
    replicas: int,
    warmup: Callable[[int], int],
    defer: Callable[[int], int],
) -> Schedule:
    check_positive(stages=stages, microbatches=microbatches, replicas=replicas)
    programs = [split_program(p, microbatches, warmup(p), defer(p)) for p in range(stages)]
    return replicated(kind, stages, microbatches, replicas, lambda p, r: to_ops(programs[p], r))


def zb_h1(stages: int, microbatches: int, replicas: int = 1) -> Schedule:
    """ZB-H1: 1F1B's memory (peak <= P), start-up bubble (P-1)(F+B-W)."""
    return _split_schedule(
        "zb-h1", stages, microbatches, replicas, lambda p: stages - p, lambda p: p
    )


def zb_h2(stages: int, microbatches: int, replicas: int = 1) -> Schedule:
    """ZB-H2: twice 1F1B's memory (peak <= 2P) buys a bubble-free span."""
    return _split_schedule(
        "zb-h2", stages, microbatches, replicas, lambda p: 2 * (stages - p) - 1, lambda p: 2 * p
    )
