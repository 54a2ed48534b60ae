"""Held memory as (units, B-pool rows, W-pool rows) tuples (ir.memory.MemoryBound):
sums and peaks, and how far a worker's memory must still rise for the rest of
its program. The greedy's inner loop (tick_packing/greedy.py) runs these a
hundred thousand times, so they work on plain tuples, by hand.
"""

from __future__ import annotations

Held = tuple[int, int, int]  # (units, B-pool rows, W-pool rows)


def rise(window: list[tuple[int, Held]], skip: set[int]) -> Held:
    """How far a worker's memory must still rise running the `window` of its unplaced
    ops (greedy_ticks.GreedyPacker._window: (position, delta)) in program order,
    the positions in `skip` left out (the tick's), per resource: an op that
    overtakes keeps this much room free, so the program order stays possible
    (no deadlock)."""
    units = b_rows = w_rows = 0
    rise_units = rise_b = rise_w = 0
    for i, (du, db, dw) in window:
        if i not in skip:
            units, b_rows, w_rows = units + du, b_rows + db, w_rows + dw
            # (comparisons, not max(): this loop is the greedy's hottest)
            if units > rise_units:
                rise_units = units
            if b_rows > rise_b:
                rise_b = b_rows
            if w_rows > rise_w:
                rise_w = w_rows
    return rise_units, rise_b, rise_w


def add(a: Held, b: Held) -> Held:
    """The sum of two holdings, per resource."""
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def highest(a: Held, b: Held) -> Held:
    """The larger of two holdings, per resource (a peak)."""
    return max(a[0], b[0]), max(a[1], b[1]), max(a[2], b[2])
