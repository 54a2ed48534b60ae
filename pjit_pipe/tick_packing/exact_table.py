"""The optimal tick table of a small schedule (one iteration), as a HiGHS MILP.

It solves the problem `pack_ticks` solves greedily, so that tests can measure
how far the greedy is from the optimum. The MILP (tick_packing/tick_milp.py) has a
fixed lane order and send timing, so there is one per order (F, B, W and B,
W, F) and, where C > 0, per timing (sent at once or deferred,
tick_packing/send_timing.py), and the best wins, as `pack_ticks` keeps the best
of its tables. The horizon is
the larger of the greedy's and the unpacked table's tick counts (both
feasible), so the optimum is over tables of at most that many ticks. Only
sizes of a few dozen ops solve quickly.
"""

from __future__ import annotations

import dataclasses

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import LANE_ORDERS, PackedTicks
from pjit_pipe.simulator import lockstep_lower_bound, packed_time
from pjit_pipe.tick_packing.packer import pack_ticks
from pjit_pipe.tick_packing.tick_milp import ExactResult, solve_ticks


def exact_pack(
    schedule: Schedule,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    time_limit: float = 60.0,
) -> PackedTicks:
    """The cheapest one-iteration tick table of `schedule` (see the module docstring),
    within `mem_limit` (None: the schedule's own largest peak, as `pack_ticks`).
    Raises ScheduleError when HiGHS proves no optimum within `time_limit` seconds."""
    result = exact_bounds(schedule, costs, mem_limit, time_limit)
    if not result.optimal or result.table is None:
        raise ScheduleError(
            f"exact_pack: HiGHS found no optimum in {time_limit:g} s (best {result.time:g}, "
            f"lower bound {result.bound:g}); raise time_limit or use exact_bounds"
        )
    return result.table


def exact_bounds(
    schedule: Schedule,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    time_limit: float = 60.0,
) -> ExactResult:
    """Solve `exact_pack`'s MILP, once per lane order (ir/ticks.py), for at most
    `time_limit` seconds each, and report the best table found and the proven lower
    bound (the optimum lies between them): the larger of HiGHS's and
    `simulator.bounds.lockstep_lower_bound`, which no table beats. A greedy table
    that reaches the latter is optimal without a solve."""
    costs = costs or Costs()
    greedy = pack_ticks(schedule, costs, 1, mem_limit)
    # The MILP leaves the OPTs out of a table's time, and so does this bound.
    free_steps = dataclasses.replace(costs, opt=0.0)
    floor = lockstep_lower_bound(schedule, free_steps)
    price = packed_time(greedy, free_steps)
    if price <= floor + 1e-9:  # the greedy's table reaches a bound no table beats
        return ExactResult(greedy, price, floor, True)
    unpacked = PackedTicks.one_op_per_tick(schedule)
    # Horizon: the greedy's and the unpacked table's tick counts (both feasible).
    horizon = max(len(greedy), len(unpacked))
    # Where a deferred table can cost less (C > 0, a schedule the lowering may defer),
    # each order is solved with either send timing.
    timings = (False, True) if costs.c > 0 and not schedule.asynchronous else (False,)
    results = [
        # The greedy's table is HiGHS's first solution for its own order, the unpacked
        # table (valid in every order) for the other.
        solve_ticks(
            schedule,
            costs,
            mem_limit,
            time_limit,
            order,
            horizon,
            greedy if greedy.order == order else unpacked,
            deferred=deferred,
        )
        for order in LANE_ORDERS
        for deferred in timings
    ]
    best = min(results, key=lambda r: r.time)
    bound = max(floor, min(r.bound for r in results))
    optimal = all(r.optimal for r in results) or best.time <= bound + 1e-9
    return ExactResult(best.table, best.time, bound, optimal)
