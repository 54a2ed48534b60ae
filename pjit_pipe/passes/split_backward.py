"""Split every fused backward BW into B followed at once by W.

Splitting changes nothing about timing by itself (B+W costs what BW costs);
it exposes W as a separate op that later passes (defer_w) can move into bubbles.
"""

from __future__ import annotations

from pjit_pipe.ir.ops import Kind, Op
from pjit_pipe.ir.schedule import Schedule


def _split(op: Op) -> tuple[Op, ...]:
    if op.kind is not Kind.BW:
        return (op,)
    return (op._replace(kind=Kind.B), op._replace(kind=Kind.W))


def split_backward(schedule: Schedule) -> Schedule:
    """Every BW becomes B immediately followed by W on the same worker."""
    programs = {
        w: [piece for op in prog for piece in _split(op)] for w, prog in schedule.programs.items()
    }
    return schedule.replace(programs=programs, kind=f"{schedule.kind}+split")
