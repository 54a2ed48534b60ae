"""GPipe and 1F1B: the fused-backward (BW) schedules every paper compares against."""

from __future__ import annotations

from pjit_pipe.ir.ops import BW, F, Op
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.schedules.common import check_positive, replicated


def gpipe(stages: int, microbatches: int, replicas: int = 1) -> Schedule:
    """All forwards, then all backwards: activation memory m per worker."""
    check_positive(stages=stages, microbatches=microbatches, replicas=replicas)

    def program(p: int, r: int) -> list[Op]:
        return [F(p, j, r) for j in range(microbatches)] + [
            BW(p, j, r) for j in range(microbatches)
        ]

    return replicated("gpipe", stages, microbatches, replicas, program)


def one_f_one_b(stages: int, microbatches: int, replicas: int = 1) -> Schedule:
    """PipeDream-flush 1F1B: P-p-1 warm-up forwards, then alternate F and BW.

    Peak activation memory is min(P-p, m) on position p.
    """
    check_positive(stages=stages, microbatches=microbatches, replicas=replicas)

    def program(p: int, r: int) -> list[Op]:
        warmup = min(stages - p - 1, microbatches)
        ops = [F(p, j, r) for j in range(warmup)]
        for j in range(microbatches - warmup):
            ops += [F(p, warmup + j, r), BW(p, j, r)]
        ops += [BW(p, j, r) for j in range(microbatches - warmup, microbatches)]
        return ops

    return replicated("1f1b", stages, microbatches, replicas, program)
