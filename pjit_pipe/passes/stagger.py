"""Optimizer staggering: each stage steps its optimizer as soon as its own gradients are done.

Without it every worker waits at an iteration barrier for the slowest OPT; with
it a stage starts the next iteration right after its own OPT, so the steady
iteration period shrinks from the makespan towards the span.
"""

from __future__ import annotations

from pjit_pipe.ir.ops import Kind, Op
from pjit_pipe.ir.schedule import Schedule


def _stagger_program(program: tuple[Op, ...]) -> list[Op]:
    """Re-insert each OPT right after the last W/BW of its stage (or keep it last).

    SENDs that directly follow that W/BW stay ahead of the OPT: they cost nothing
    and another worker may be waiting for them.
    """
    opts = [op for op in program if op.kind is Kind.OPT]
    rest = [op for op in program if op.kind is not Kind.OPT]
    slot: dict[int, int] = {}  # stage -> index in `rest` after which its OPT goes
    for i, op in enumerate(rest):
        if op.kind in (Kind.W, Kind.BW):
            slot[op.stage] = i
    for stage, i in slot.items():
        while i + 1 < len(rest) and rest[i + 1].kind is Kind.SEND:
            i += 1
        slot[stage] = i
    after: dict[int, list[Op]] = {}
    for opt in opts:
        after.setdefault(slot.get(opt.stage, len(rest) - 1), []).append(opt)
    out = list(after.get(-1, ()))
    for i, op in enumerate(rest):
        out.append(op)
        out.extend(after.get(i, ()))
    return out


def stagger(schedule: Schedule) -> Schedule:
    """Move every OPT right after its stage's last W/BW and drop the iteration barrier."""
    programs = {w: _stagger_program(prog) for w, prog in schedule.programs.items()}
    return schedule.replace(programs=programs, staggered=True, kind=f"{schedule.kind}+stagger")
