"""Explicit communication: a SEND after each producer and a RECV before each consumer.

Only tensors that cross workers get them (the turn of a V layout stays on one
worker). A SEND never blocks and a RECV sits right before the op that needs
its tensor, so every op waits for exactly what it waited for before: the
result cannot deadlock, and its timing (RECV = SEND + C) equals the implicit one.
"""

from __future__ import annotations

from collections import defaultdict

from pjit_pipe.ir.ops import COMM_KINDS, RECV, SEND, Kind, Op, Payload, Worker
from pjit_pipe.ir.schedule import Schedule


def _consumer(schedule: Schedule, op: Op) -> Op | None:
    """The op on the next stage that consumes what `op` produces (None at the ends)."""
    s, j, r = op.stage, op.mb, op.replica
    if op.kind is Kind.F:
        return Op(Kind.F, s + 1, j, r) if s + 1 < schedule.num_virtual_stages else None
    if op.kind in (Kind.B, Kind.BW) and s > 0:
        split = Op(Kind.B, s - 1, j, r)
        return split if schedule.where(split) is not None else Op(Kind.BW, s - 1, j, r)
    return None


def insert_comm(schedule: Schedule) -> Schedule:
    """Add SEND/RECV for every cross-worker activation and gradient (existing ones are replaced)."""
    programs = {
        w: [op for op in prog if op.kind not in COMM_KINDS] for w, prog in schedule.programs.items()
    }
    sends: dict[Op, list[Op]] = defaultdict(list)  # producer -> SENDs right after it
    recvs: dict[Op, list[Op]] = defaultdict(list)  # consumer -> RECVs right before it
    for src, prog in programs.items():
        for op in prog:
            consumer = _consumer(schedule, op)
            dst: Worker | None = schedule.where(consumer) if consumer else None
            if dst is None or dst == src:
                continue
            payload = Payload.ACT if op.kind is Kind.F else Payload.GRAD
            sends[op].append(SEND(payload, op.stage, op.mb, op.replica, dst))
            recvs[consumer].append(RECV(payload, op.stage, op.mb, op.replica, src))
    out = {}
    for w, prog in programs.items():
        out[w] = [x for op in prog for x in (*recvs.get(op, ()), op, *sends.get(op, ()))]
    return schedule.replace(programs=out, kind=f"{schedule.kind}+comm")
