"""When a packed table sends its late channel: in the tick that fills it, or at the
start of the next (ir/ticks.py, `PackedTicks.deferred`).

Sent at once, a message's transfer C overlaps its worker's later lanes, and
the tick waits for it: a tick whose last op sends lasts C longer than its
work. Deferred, the transfer overlaps the receiver's first lane of the next
tick instead, and only the op that reads the message waits for it. Neither
timing wins everywhere (deferred, a tick whose receivers have no first-lane
op pays C at its start), so the table takes the one its lockstep price finds
cheaper. The greedy packs for either price (`GreedyPacker(deferred=...)`); the
exact engine packs with messages sent at once.
"""

from __future__ import annotations

import dataclasses

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.simulator.simulate import TickPricer


def cheaper_timing(
    table: PackedTicks, costs: Costs, pricer: TickPricer | None = None
) -> PackedTicks:
    """`table`, deferred or not, whichever is cheaper under `costs` (not deferred on a
    tie; `pricer`: a `TickPricer` of the table's schedule and `costs` to price
    with). An asynchronous table is never deferred (its carried messages cross
    calls, lowering/steady_window.py)."""
    if table.schedule.asynchronous:
        return dataclasses.replace(table, deferred=False)
    pricer = pricer or TickPricer(table.schedule, costs)
    now, late = (dataclasses.replace(table, deferred=d) for d in (False, True))
    return late if pricer.time(late) < pricer.time(now) - 1e-9 else now
