"""Asynchronous 1F1B (PipeDream, and PipeOptim's base): no flush, a step per microbatch.

Each position p runs 1F1B's order (P-p-1 warm-up forwards, then F and BW
alternating), but steps its optimizer right after every backward, so the next
iteration's forwards fill the cool-down: in steady state every worker runs
F, BW, OPT back to back and the iteration period is m(F+B+W). The price is
weight staleness: between a microbatch's forward and its backward on position
p, s = P-p-1 updates land (the paper's s; PipeOptim's code uses P-p; the
lowering reads s from the program: `pjit_pipe.lowering.async_pipeline.async_weights.staleness`).
"""

from __future__ import annotations

from pjit_pipe.ir.ops import BW, OPT, F, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError, interleaved_layout
from pjit_pipe.schedules.common import check_positive

KIND = "async-1f1b"


def async_one_f_one_b(
    stages: int, microbatches: int, replicas: int = 1, *, stale: bool = True
) -> Schedule:
    """PipeDream's asynchronous 1F1B: 1F1B order with OPT(p, j) after each BW(p, j).

    Needs microbatches >= stages, so that every warm-up forward of the next
    iteration has a backward of this one to pair with. stale=False (for tests)
    drops the warm-up: every position runs F, BW, OPT of one microbatch before
    the next one's F, so s = 0 everywhere and training is per-microbatch
    synchronous SGD (with a (P-1)-stage bubble per microbatch).
    """
    check_positive(stages=stages, microbatches=microbatches, replicas=replicas)
    if microbatches < stages:
        raise ScheduleError(
            f"{KIND} needs microbatches >= {stages} = stages (got microbatches={microbatches}): "
            "raise microbatches or use 1f1b"
        )

    def program(p: int, r: int) -> list[Op]:
        warmup = stages - p - 1 if stale else 0
        ops = [F(p, j, r) for j in range(warmup)]
        for j in range(microbatches - warmup):
            ops += [F(p, warmup + j, r), BW(p, j, r), OPT(p, r, j)]
        for j in range(microbatches - warmup, microbatches):
            ops += [BW(p, j, r), OPT(p, r, j)]
        return ops

    programs = {Worker(r, p): program(p, r) for r in range(replicas) for p in range(stages)}
    return Schedule(
        stages=stages,
        chunks=1,
        microbatches=microbatches,
        replicas=replicas,
        layout=interleaved_layout(stages, 1),
        programs=programs,
        staggered=True,  # no iteration barrier: each stage steps on its own
        kind=KIND,
    )
