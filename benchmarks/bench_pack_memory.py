"""The activation memory a packed tick table needs to run at the schedule's price.

Within the schedule's own peak (pack_ticks' default), some cases of the
lockstep grid (bench_lockstep.py) stay above 1.05x the event-driven steady
period: a message needs a tick to cross, so a microbatch's round trip spans
more ticks than the schedule holds activations for. `pack_ticks(...,
mem_limit=)` trades memory for speed; this finds, for each such case, the
smallest limit (in quarter units of docs/design.md section 3, by bisection
between the own peak and the unbounded table's peak) whose table is within
1.05x, and that table's period. The packer is not monotone in its limit, so
a smaller limit may exist off the bisection's path.

Run: python -m benchmarks.bench_pack_memory [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import itertools
import math

from benchmarks.common import kind_cases, periods, rerouted_cases
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import largest_peak

TARGET = 1.05
STEP = 0.25  # memory units: a chunk of a two-chunk layout holds half an activation


def smallest_limit(schedule, costs: Costs, event: float, low: float, high: float):
    """(limit, period ratio) of the smallest limit on the STEP grid in (low, high]
    whose packed table is within TARGET, by bisection; `high` must be one."""
    steps = round((high - low) / STEP)
    lo, hi = 0, steps  # lo fails (the own peak), hi passes
    found = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ratio = periods(schedule, costs, low + mid * STEP)[2] / event
        if ratio <= TARGET:
            hi, found = mid, ratio
        else:
            lo = mid
    if found is None:
        found = periods(schedule, costs, low + hi * STEP)[2] / event
    return low + hi * STEP, found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P=4 m=8 and re-routed 4x4 only")
    args = parser.parse_args(argv)
    sizes = [(4, 8)] if args.quick else [(4, 8), (8, 32)]
    print(
        f"| case | costs | own peak | at own peak | memory for {TARGET} (x own) "
        "| there | unbounded: memory, period |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, sched, costs_text in itertools.chain(
        kind_cases(sizes, with_async=False), rerouted_cases()
    ):
        costs = Costs.parse(costs_text)
        event, _, own_period, _ = periods(sched, costs)
        if own_period / event <= TARGET:
            continue
        own = largest_peak(sched)
        _, _, free_period, free_table = periods(sched, costs, math.inf)
        free_peak = max(free_table.peak_memory().values())
        free = f"{free_peak:g}, {free_period / event:.3f}"
        if free_period / event > TARGET:
            needed = "-"
        else:
            limit, ratio = smallest_limit(sched, costs, event, own, max(free_peak, own + STEP))
            needed = f"{limit:g} ({limit / own:.2f}) | {ratio:.3f}"
        needed = needed if needed != "-" else "- | -"
        print(
            f"| {label} | {costs_text} | {own:g} | {own_period / event:.3f} | {needed} | {free} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
