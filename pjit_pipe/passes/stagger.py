"""Optimizer staggering: each stage steps its optimizer as soon as its own gradients are done.

Without it every worker waits at an iteration barrier for the slowest OPT; with
it a stage starts the next iteration right after its own OPT, so the steady
iteration period shrinks from the makespan towards the span.
"""

from __future__ import annotations

from pjit_pipe.ir.engine import DeadlockError, Engine
from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule


def _move_opt(program: tuple[Op, ...], opt: Op) -> tuple[Op, ...]:
    """`program` with `opt` right after the last W/BW of its stage (unchanged if there is none).

    SENDs that directly follow that W/BW stay ahead of the OPT: they cost nothing
    and another worker may be waiting for them.
    """
    rest = [op for op in program if op != opt]
    grads = [
        i for i, op in enumerate(rest) if op.kind in (Kind.W, Kind.BW) and op.stage == opt.stage
    ]
    if not grads:
        return program
    at = grads[-1] + 1
    while at < len(rest) and rest[at].kind is Kind.SEND:
        at += 1
    return (*rest[:at], opt, *rest[at:])


def _deadlock_free(schedule: Schedule) -> bool:
    try:
        Engine(schedule).run(lambda w, op: 1.0, lambda a, b: 0.0)
    except DeadlockError:
        return False
    return True


def stagger(schedule: Schedule) -> Schedule:
    """Move every OPT right after its stage's last W/BW and drop the iteration barrier.

    With data parallelism an OPT also waits for the other replicas' gradients. When
    moving all OPTs at once makes replicas wait on each other in a cycle (possible
    only when their programs differ, as after re-routing), OPTs are moved one at a
    time and an OPT whose move would deadlock stays where it was.
    """
    if schedule.asynchronous:
        return schedule  # it already steps each stage after every backward, with no barrier
    opts = [
        (w, op) for w in schedule.alive_workers for op in schedule.program(w) if op.kind is Kind.OPT
    ]
    programs: dict[Worker, tuple[Op, ...]] = dict(schedule.programs)
    for w, opt in opts:
        programs[w] = _move_opt(programs[w], opt)
    if not _deadlock_free(schedule.replace(programs=programs)):
        programs = dict(schedule.programs)
        for w, opt in opts:
            trial = {**programs, w: _move_opt(programs[w], opt)}
            if _deadlock_free(schedule.replace(programs=trial)):
                programs = trial
    return schedule.replace(programs=programs, staggered=True, kind=f"{schedule.kind}+stagger")
