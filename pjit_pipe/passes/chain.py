"""Composing IR -> IR passes, the way `optax.chain` composes gradient transforms.

A pass is any callable from a schedule to a schedule; the ones with knobs
(costs, memory limit, how far to postpone) are bound first with
`functools.partial` or a small factory such as `postpone_w(defer)`.
`chain(a, b, c)(s)` is `c(b(a(s)))`: generators state their recipe as one
value, and a chain is itself a pass, so chains nest.
"""

from __future__ import annotations

from collections.abc import Callable

from pjit_pipe.ir.schedule import Schedule

Pass = Callable[[Schedule], Schedule]


def chain(*passes: Pass) -> Pass:
    """One pass that applies `passes` left to right (no passes: the identity)."""
    for i, p in enumerate(passes):
        if not callable(p):
            raise TypeError(
                f"chain: pass #{i} is {p!r}, not a callable Schedule -> Schedule; "
                "bind a pass's options with functools.partial first"
            )

    def chained(schedule: Schedule) -> Schedule:
        for p in passes:
            schedule = p(schedule)
        return schedule

    return chained


def renamed(kind: str) -> Pass:
    """A pass that only sets the schedule's `kind` (what a chain's result is called)."""
    return lambda schedule: schedule.replace(kind=kind)
