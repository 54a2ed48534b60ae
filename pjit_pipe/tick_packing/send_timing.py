"""When a packed table sends its late channel: in the tick that fills it, or at the
start of the next (ir/ticks.py, `PackedTicks.deferred`).

Sent at once, a message's transfer C overlaps its worker's later lanes, and
the tick waits for it: a tick whose last op sends lasts C longer than its
work. Deferred, the transfer overlaps the receiver's first lane of the next
tick instead, and only the op that reads the message waits for it. Neither
timing wins everywhere (deferred, a tick whose receivers have no first-lane
op pays C at its start), so the table takes the one its lockstep price finds
cheaper. The greedy and the exact engine pack for either price
(`GreedyPacker(deferred=...)`, `tick_milp.solve_ticks(deferred=...)`).
"""

from __future__ import annotations

import dataclasses

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.simulator import TickPricer


def cheaper_timing(table: PackedTicks, costs: Costs) -> PackedTicks:
    """`table`, deferred or not, whichever is cheaper under `costs` (not deferred on a
    tie). An asynchronous table is never deferred (its carried messages cross
    calls, lowering/async_pipeline/steady_window.py)."""
    return at_cheaper_timing(table, TickPricer(table.schedule, costs))[0]


def at_cheaper_timing(table: PackedTicks, pricer: TickPricer) -> tuple[PackedTicks, float]:
    """(`cheaper_timing`'s table, its price) under `pricer` (a `TickPricer` of the
    table's schedule): both timings priced once, for the packer's loops."""
    if table.schedule.asynchronous:
        now = dataclasses.replace(table, deferred=False)
        return now, pricer.time(now)
    now, late = (dataclasses.replace(table, deferred=d) for d in (False, True))
    now_price, late_price = pricer.time(now), pricer.time(late)
    return (late, late_price) if late_price < now_price - 1e-9 else (now, now_price)
