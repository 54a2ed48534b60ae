"""Pack each worker's program into ticks: the table the lowering compiles.

A tick of the compiled program lasts as long as its slowest worker (plus a
transfer time where a message leaves a worker after its last op). Running one
op per tick makes a worker doing F wait for a neighbour doing BW; packing
several ops of a worker into one tick (ir/ticks.py's lane rule: at most one
F, one B and two W's, or one F and one BW, in the table's lane order) lets
every worker fill the tick. The objective is the sum over ticks of the
tick's length, as the simulator's lockstep mode prices it
(`simulator.simulate.packed_events`), plus each tick's fixed cost
(`Costs.tick`): when ticks are dear, fewer win.

`pack_ticks` is the one function that builds the table: the frontend hands
its result to the lowering and the CLI prices it. It runs a fast greedy
(tick_packing/greedy.py) in a few variants (`VARIANTS`) under each lane
order (F, B, W and B, W, F), each taking one W a tick and then two, and
where C > 0 each again pricing ticks as a deferred table runs them
(tick_packing/send_timing.py), improves each table by a local search that pulls
ops one tick earlier (`tick_packing/pull_forward.py`), sends each at its cheaper
timing, and keeps the cheapest (ties: the earlier variant, F, B, W before
B, W, F); a synchronous schedule packs one iteration
and repeats it (behind the barrier every iteration starts from the same
state); a table that reaches `simulator.bounds.lockstep_lower_bound` ends the
search. `exact_pack` (a HiGHS MILP) finds the optimum of small cases, to
check the greedy against; `polish=` re-solves windows of a one-iteration
table with that MILP (tick_packing/tick_milp.py).

Memory: a worker's ops run in program order except where a younger op
overtakes one that waits, and then only within the memory limit, checked op
by op in the tick's lane order. The default limit is the schedule's own
peak, so the packed program holds no more activations than the schedule
says; B, W, F ticks free before they allocate, which is what lets them pack
within it. OPTs and the iteration barrier follow the rule of ir/ticks.py, so
staggered schedules keep their placement. An asynchronous schedule
(async-1f1b) is not packed: its table must run each worker's ops in their
exact stream order (which weights a forward reads depends on the OPTs before
it), so `pack_ticks` returns its unpacked table.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import largest_peak
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import (
    LANE_ORDERS,
    W_PER_TICK,
    LaneOrder,
    PackedTicks,
    compute_only,
)
from pjit_pipe.simulator import TickPricer, check_sync, lockstep_lower_bound
from pjit_pipe.tick_packing.greedy import VARIANTS, GreedyPacker, PackingFacts
from pjit_pipe.tick_packing.pull_forward import PullForward
from pjit_pipe.tick_packing.send_timing import at_cheaper_timing
from pjit_pipe.tick_packing.tick_milp import polish_ticks

T = TypeVar("T")


def pack_ticks(
    schedule: Schedule,
    costs: Costs | None = None,
    iterations: int = 1,
    mem_limit: float | None = None,
    orders: Sequence[LaneOrder] = LANE_ORDERS,
    polish: float = 0.0,
    sync: str = "global",
) -> PackedTicks:
    """The tick table the lowering compiles for `iterations` back-to-back iterations
    of `schedule`, packed to run fast under `costs` (the cheapest greedy variant,
    in the cheaper of the lane `orders` of ir/ticks.py: F, B, W or B, W, F).

    mem_limit bounds each worker's in-flight activation memory (docs/design.md
    section 3 units) when a younger op runs ahead of one that waits. None takes
    the schedule's own peak (the largest worker's), in units and in each residual
    pool's rows (`ir.memory.MemoryBound`): one SPMD program sizes every device's
    residual stores for the largest, so the packed program then holds no more
    than the unpacked one. A number bounds the units alone; a larger one
    (math.inf: none) trades memory for speed (`PackedTicks.peak_memory` tells
    what a table holds).
    An asynchronous schedule gets its unpacked table (module docstring).

    polish > 0 improves the one-iteration table by exact solves of windows of
    its ticks (`tick_milp.polish_ticks`, HiGHS, at most `polish` seconds per
    window; 2 is plenty at P=4 m=8, where it takes up to 15 s in all and finds
    1-9% on the zero-bubble kinds). More iterations repeat it; a staggered
    schedule keeps the cheaper of that and the greedy's own multi-iteration
    table.

    sync: the price the table is chosen by, as the runtime that runs it
    synchronizes ticks (simulator/tick_sync.py): "global" (one process, whose
    collectives meet in a rendezvous of every device) or "neighbor" (one
    process per device, where a ppermute is a send/recv between its pairs).
    The greedy variants are the same; the cheapest under `sync` is kept."""
    if not isinstance(iterations, int) or iterations < 1:
        raise ScheduleError(f"iterations must be a positive integer, got {iterations!r}")
    orders = tuple(orders)
    if not orders or any(o not in LANE_ORDERS for o in orders):
        raise ScheduleError(
            f"orders must be a non-empty selection of {LANE_ORDERS} "
            f"(ir.ticks.FORWARD_FIRST, ir.ticks.FORWARD_LAST), got {orders!r}"
        )
    if isinstance(polish, bool) or not isinstance(polish, int | float) or not polish >= 0:
        raise ScheduleError(
            f"polish must be a number of seconds >= 0 (0: the greedy's table), got {polish!r}"
        )
    check_sync(sync)
    if sync != "global" and polish:
        raise ScheduleError(
            f"polish prices global lockstep only; pack with sync='global' or polish=0 "
            f"(got sync={sync!r}, polish={polish!r})"
        )
    costs = costs or Costs()
    # A pipeline, its rebuilt copies and the CLI's pricing pack the same schedule again.
    return _cached(
        _PACKED,
        schedule,
        (costs, iterations, mem_limit, orders, polish, sync),
        lambda: _pack(schedule, costs, iterations, mem_limit, orders, polish, sync),
    )


# Packed tables by (schedule, costs, iterations, mem_limit, orders, polish): packing a
# P=4 schedule takes 0.05-0.9 s, as long as a small pipeline's trace.
_PACKED: dict = {}
# lockstep_lower_bound by (schedule, costs): packing a schedule within its own peak and
# then unbounded asks twice (0.3 s at P=8 m=32).
_FLOORS: dict = {}
_CACHE_SIZE = 128  # entries kept in each


def _cached(store: dict, schedule: Schedule, rest: tuple, make: Callable[[], T]) -> T:
    """make(), kept in `store` by (schedule, *rest), the oldest entry dropped past
    _CACHE_SIZE; made afresh each time where the key cannot be hashed (per-stage
    costs given as lists)."""
    try:
        key = (_schedule_key(schedule), *rest)
        hash(key)
    except TypeError:
        return make()
    if key not in store:
        if len(store) >= _CACHE_SIZE:
            store.pop(next(iter(store)))  # the oldest
        store[key] = make()
    return store[key]


def _schedule_key(schedule: Schedule) -> tuple:
    """Every compared field of `schedule` (its programs as sorted items): equal
    schedules, equal keys, equal tables."""
    values = (getattr(schedule, f.name) for f in dataclasses.fields(schedule) if f.compare)
    return tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in values)


def _pack(
    schedule: Schedule,
    costs: Costs,
    iterations: int,
    mem_limit: float | None,
    orders: tuple[LaneOrder, ...],
    polish: float,
    sync: str = "global",
) -> PackedTicks:
    """`pack_ticks` without its argument check and cache: the cheapest table the
    greedy variants (and polishing) find, each sent at its cheaper timing
    (`send_timing.at_cheaper_timing`)."""
    sched = compute_only(schedule)
    # The unpacked table is a candidate too: packing never makes a schedule slower.
    # (With one op per worker and tick it is a table of every lane order.)
    best = dataclasses.replace(PackedTicks.one_op_per_tick(schedule, iterations), order=orders[0])
    if schedule.asynchronous:
        return best
    pricer = TickPricer(schedule, costs, sync)  # every candidate is a table of `schedule`
    best, best_price = at_cheaper_timing(best, pricer)
    # Of two tables of one price, the one that runs more loss-stage groups as one op
    # (ir.ticks.fused_loss_ops): without `Costs.fbw` fusing is priced as free, and
    # measured it saves a quarter of those ops (docs/tick_packing.md, "On a GPU").
    # A table at the bound is then final once it fuses every group or one greedy
    # variant has had its try (the first fuses every group it can fit for free).
    ties = costs.fbw is None
    most = iterations * sum(
        op.kind is Kind.F and op.stage == sched.num_virtual_stages - 1 for _, _, op in sched.ops()
    )
    best_fused = best.fused_groups()

    def better(table: PackedTicks, price: float) -> bool:
        if price < best_price - 1e-9:
            return True
        return ties and price <= best_price + 1e-9 and table.fused_groups() > best_fused

    def keep(table: PackedTicks, price: float) -> None:
        nonlocal best, best_price, best_fused
        best, best_price, best_fused = table, price, table.fused_groups()

    if mem_limit is not None and mem_limit >= largest_peak(schedule):
        # The table within the schedule's own peak is a table of every looser limit
        # (the greedy is not monotone in its limit: more room, other choices).
        tight = pack_ticks(schedule, costs, iterations, None, orders, polish, sync)
        price = pricer.time(tight)
        if better(tight, price):
            keep(tight, price)
    # No one-iteration table costs less than this under global lockstep (a neighbour-
    # synchronous one may: no floor then): a table that reaches it is
    # optimal, so the variants after it (and polishing) cannot improve on it.
    floor = (
        _cached(_FLOORS, schedule, (costs,), lambda: lockstep_lower_bound(schedule, costs))
        if iterations == 1 and sync == "global"
        else -math.inf
    )
    if iterations > 1:
        # Behind the iteration barrier every iteration starts from the same state
        # (nothing in flight), so the best one-iteration table, repeated, is as good as
        # any the greedy builds for all of them at once, and costs 1/iterations to build.
        # It is valid staggered too (each stage steps before its next iteration).
        table = _repeat(_pack(schedule, costs, 1, mem_limit, orders, polish, sync), iterations)
        price = pricer.time(table)
        if better(table, price):
            keep(table, price)
        if not schedule.staggered:
            return best
    # Each variant with one W a tick first, then with W_PER_TICK (where the schedule
    # has W's): a greedy that may take a second W takes other ops later, which is
    # not always cheaper.
    has_w = any(op.kind is Kind.W for _, _, op in sched.ops())
    # Then those of the utilization rule again, packing for the deferred price
    # (send_timing.py), where that can differ (C > 0; an asynchronous schedule
    # returned above). Measured on the grid of docs/tick_packing.md at 5,6,4,1
    # (1f1b, zb-h1, zb-h2, zb-v, auto, re-routed zb-h1; both memory limits), every
    # table only a deferred greedy found came from that rule; the other rules'
    # deferred runs would cost a third more packing time for nothing.
    ws_options = (1, W_PER_TICK) if has_w else (1,)
    variants = list(itertools.product((False,), orders, VARIANTS, ws_options))
    if costs.c > 0:
        deferred_variants = [v for v in VARIANTS if v[0] == "utilization"]
        variants += itertools.product((True,), orders, deferred_variants, ws_options)
    facts = PackingFacts(sched, costs, mem_limit)
    for tried, (deferred, order, (rule, overtaking_w, lazy_w), ws) in enumerate(variants):
        if best_price <= floor + 1e-9 and (not ties or best_fused == most or tried):
            return best
        greedy = GreedyPacker(
            sched, costs, iterations, mem_limit, overtaking_w, lazy_w, order, ws, facts, deferred
        )
        table = greedy.run(rule)
        ticks = tuple(PullForward(greedy, table).run())
        table, price = at_cheaper_timing(PackedTicks(schedule, iterations, ticks, order), pricer)
        if better(table, price):
            keep(table, price)
    if polish and iterations == 1 and best_price > floor + 1e-9:
        # (more iterations repeat a polished one above)
        best = polish_ticks(best, costs, mem_limit, polish)
    return best


def _repeat(table: PackedTicks, iterations: int) -> PackedTicks:
    """A one-iteration table of a synchronous schedule run `iterations` times back to
    back (its last tick holds its last OPT, so the barrier holds)."""
    ticks = tuple(
        {w: tuple((k, op) for _, op in entries) for w, entries in tick.items()}
        for k in range(iterations)
        for tick in table.ticks
    )
    return PackedTicks(table.schedule, iterations, ticks, table.order, table.deferred)
