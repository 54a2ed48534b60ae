"""Interleaved 1F1B (Megatron-LM): v chunks per position cut the start-up bubble by v.

Virtual stage c*P + p lives on position p (`interleaved_layout`). Each position
walks its chunks in groups of P microbatches: forwards of microbatches
0..P-1 on chunk 0, then on chunk 1, ..., then the next group; backwards
(fused BW) in the same order with the chunks reversed. After a warm-up of
2(P-p-1) + (v-1)P chunk forwards it alternates one forward and one backward.
Needs microbatches to be a multiple of P (the groups); chunks >= 2, since
chunks=1 is plain 1f1b. Bubble (P-1)(F+B+W)/v at C=0.
"""

from __future__ import annotations

from pjit_pipe.ir.ops import BW, F, Op
from pjit_pipe.ir.schedule import Schedule, ScheduleError, interleaved_layout
from pjit_pipe.schedules.common import check_positive, replicated


def _virtual(k: int, stages: int, chunks: int, backward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of a position's k-th forward (or backward)."""
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    return (chunks - 1 - chunk if backward else chunk), group * stages + within % stages


def interleaved_1f1b(stages: int, microbatches: int, chunks: int, replicas: int = 1) -> Schedule:
    """Megatron's interleaved 1F1B with `chunks` virtual stages per position."""
    check_positive(stages=stages, microbatches=microbatches, chunks=chunks, replicas=replicas)
    if chunks < 2:
        raise ScheduleError(
            f"interleaved-1f1b needs chunks >= 2 (got chunks={chunks}; chunks=1 is plain 1f1b)"
        )
    if microbatches % stages:
        raise ScheduleError(
            f"interleaved-1f1b needs microbatches to be a multiple of stages={stages} "
            f"(got microbatches={microbatches})"
        )
    P, v, total = stages, chunks, microbatches * chunks

    def program(p: int, r: int) -> list[Op]:
        def fwd(k: int) -> Op:
            c, j = _virtual(k, P, v, backward=False)
            return F(c * P + p, j, r)

        def bwd(k: int) -> Op:
            c, j = _virtual(k, P, v, backward=True)
            return BW(c * P + p, j, r)

        warmup = min(2 * (P - p - 1) + (v - 1) * P, total)
        ops = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [fwd(warmup + k), bwd(k)]
        return ops + [bwd(k) for k in range(total - warmup, total)]

    return replicated(
        "interleaved-1f1b",
        stages,
        microbatches,
        replicas,
        program,
        chunks=chunks,
        layout=interleaved_layout(stages, chunks),
    )
