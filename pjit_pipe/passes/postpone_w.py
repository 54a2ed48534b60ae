"""Postpone each weight-gradient op W a fixed number of microbatches on its worker.

W only updates its own stage's parameters, so it can wait; postponing it lets
the input gradient (B) reach the previous stage sooner. With `defer(p)` = p on
1F1B split into B and W this is ZB-H1: W of microbatch k runs right after B of
k + p on position p, and the Ws left over close the iteration before its OPTs.
Unlike `defer_w` (which moves Ws into the idle gaps of a timed replay), the
result depends on program order only, not on costs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from pjit_pipe.ir.ops import Kind, Op
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.passes.chain import Pass


def _postponed(program: tuple[Op, ...], defer: int) -> list[Op]:
    ws = {(op.stage, op.mb, op.replica): op for op in program if op.kind is Kind.W}
    bs = defaultdict(list)  # per (stage, home replica): that worker's Bs in program order
    for op in program:
        if op.kind is Kind.B:
            bs[(op.stage, op.replica)].append(op.mb)
    out: list[Op] = []
    placed: set[Op] = set()

    def flush_all() -> None:
        out.extend(op for op in ws.values() if op not in placed)
        placed.update(ws.values())

    for op in program:
        if op.kind is Kind.W:
            continue
        if op.kind is Kind.OPT:
            flush_all()
        out.append(op)
        if op.kind is Kind.B:
            order = bs[(op.stage, op.replica)]
            k = order.index(op.mb) - defer
            if k >= 0:
                w = ws.get((op.stage, order[k], op.replica))
                if w is not None and w not in placed:
                    out.append(w)
                    placed.add(w)
    flush_all()
    return out


def postpone_w(defer: Callable[[int], int]) -> Pass:
    """The pass: on position p, the W of the k-th B runs after the (k + defer(p))-th B."""

    def apply(schedule: Schedule) -> Schedule:
        programs = {w: _postponed(prog, defer(w.stage)) for w, prog in schedule.programs.items()}
        return schedule.replace(programs=programs, kind=f"{schedule.kind}+postpone_w")

    return apply
