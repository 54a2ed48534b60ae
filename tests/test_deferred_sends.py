"""Deferred tick tables (ir/ticks.py): the channel a table's first lane does not read
leaves at the start of the next tick, its transfer overlapping the receiver's
first lane instead of closing the tick that made it.

The price in closed form, the plan that lands those messages a tick later,
programs against jax.value_and_grad and optax (staggered, both lane orders;
re-routed), the bound that no deferred table beats, the packer's choice of
timing and its greedy's pricing of deferred ticks.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_fused_loss import train_as_optax
from test_lowering import check_value_and_grad

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import BW, OPT, F, Worker
from pjit_pipe.ir.ticks import FORWARD_FIRST, FORWARD_LAST, PackedTicks, compute_only
from pjit_pipe.lowering.tick_plan import build_plan
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.simulator.bounds import lockstep_lower_bound
from pjit_pipe.simulator.simulate import packed_time
from pjit_pipe.tick_packing.greedy import GreedyPacker
from pjit_pipe.tick_packing.packer import pack_ticks
from pjit_pipe.tick_packing.send_timing import cheaper_timing
from pjit_pipe.tick_packing.tick_milp import solve_ticks

COSTS = Costs(1, 2, 1, 0.5)  # BW = 3, a message takes half an F


def gpipe_table(deferred: bool) -> PackedTicks:
    """GPipe on two stages, three microbatches, F, B, W order: stage 0 runs each
    microbatch's F a tick before stage 1, which runs its F and BW in one tick."""
    sched = make_schedule("gpipe", 2, 3)
    w0, w1 = Worker(0, 0), Worker(0, 1)
    ticks = (
        {w0: ((0, F(0, 0)),)},
        {w0: ((0, F(0, 1)),), w1: ((0, F(1, 0)), (0, BW(1, 0)))},
        {w0: ((0, F(0, 2)), (0, BW(0, 0))), w1: ((0, F(1, 1)), (0, BW(1, 1)))},
        {w0: ((0, BW(0, 1)),), w1: ((0, F(1, 2)), (0, BW(1, 2)), (0, OPT(1)))},
        {w0: ((0, BW(0, 2)), (0, OPT(0)))},
    )
    table = PackedTicks(sched, 1, ticks, deferred=deferred)
    table.check()
    return table


def test_the_price_of_a_deferred_table_in_closed_form():
    """Sent at once, each tick whose stage-1 BW sends a gradient lasts F + BW + C:
    1.5 + 4.5 + 4.5 + 4.5 + 3 = 18. Deferred, the gradient's transfer overlaps
    stage 0's F of the next tick (ticks 1-3 last F + BW = 4), but a tick whose BW
    has no F before it waits C for its gradient (tick 3: 3.5; tick 4: 3.5):
    1.5 + 4 + 4 + 4 + 3.5 = 17."""
    assert packed_time(gpipe_table(False), COSTS) == pytest.approx(18)
    assert packed_time(gpipe_table(True), COSTS) == pytest.approx(17)
    assert cheaper_timing(gpipe_table(False), COSTS).deferred
    # Without transfer time the two cost the same, and the table is sent at once.
    free = dataclasses.replace(COSTS, c=0.0)
    assert packed_time(gpipe_table(True), free) == packed_time(gpipe_table(False), free) == 16
    assert not cheaper_timing(gpipe_table(True), free).deferred


def test_a_deferred_plan_lands_the_late_channel_a_tick_later():
    """Under F, B, W the gradients are late: each lands in the row after the tick
    that made it, in the same slot; the activations land as before."""
    devices = [Worker(0, 0), Worker(0, 1)]
    now, late = (build_plan(gpipe_table(d), False, devices) for d in (False, True))
    assert late.deferred and late.store_rows == now.store_rows + 1 == late.outbox + 1
    assert (late.rows.recv_act == now.rows.recv_act).all()
    assert (late.rows.recv_grad[:, 1:] == now.rows.recv_grad[:, :-1]).all()
    assert (late.rows.recv_grad[:, 0] == late.msg_slots).all()  # nothing lands in tick 0
    assert (now.rows.recv_grad < now.msg_slots).any()


def test_a_deferred_table_gives_value_and_grad():
    check_value_and_grad(gpipe_table(True).schedule, 1, 2, ticks=gpipe_table(True))


@pytest.mark.slow
@pytest.mark.parametrize("order", [FORWARD_FIRST, FORWARD_LAST], ids=["FBW", "BWF"])
def test_a_staggered_deferred_program_trains_as_optax_does(order):
    """Two staggered iterations of 1F1B on 2x2 in one call, the optimizer inside the
    loop, each lane order's late channel deferred."""
    sched = stagger(make_schedule("1f1b", 2, 4, replicas=2))
    table = pack_ticks(sched, Costs(1, 2, 1, 1), 2, orders=(order,))
    step = train_as_optax(sched, dataclasses.replace(table, deferred=True), seed=40)
    assert step._low.step_plan.deferred


def test_a_rerouted_deferred_program_trains_as_optax_does():
    """Two iterations of zb-h1 on 2x4 with worker (1, 2) failed, in one call, the
    gradients sent at the start of the next tick. Positions step in different
    ticks; their reduction chains are one set of ppermutes, which every device
    runs in a stepping tick (`TickPlan.updates`): run under each device's own
    predicate, as before, the ppermutes paired with other collectives and the
    second iteration's loss was 1.8% off."""
    sched = schedule_with_failures("zb-h1", 4, 4, 2, [(1, 2)], time_limit=1.0)
    table = pack_ticks(sched, Costs(1, 2, 1, 1), 2, orders=(FORWARD_FIRST,))
    step = train_as_optax(sched, dataclasses.replace(table, deferred=True), seed=41)
    assert len(set(step._low.step_plan.updates.tolist()) - {0}) > 1


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"])
def test_the_bound_stays_below_deferred_tables(kind):
    costs = Costs.parse("5,6,4,1")
    chunks = 2 if kind == "interleaved-1f1b" else None
    sched = make_schedule(kind, 4, 8, chunks=chunks, costs=costs)
    floor = lockstep_lower_bound(sched, costs)
    for mem_limit in (None, float("inf")):
        table = pack_ticks(sched, costs, mem_limit=mem_limit)
        for deferred in (False, True):
            priced = packed_time(dataclasses.replace(table, deferred=deferred), costs)
            assert floor <= priced + 1e-9


def test_pack_ticks_keeps_the_cheaper_timing():
    """Interleaved 1F1B at P=4 m=8 under the Zero Bubble paper's costs: its ticks end
    on a B, W that sends, so deferring the gradients saves C on most of them."""
    costs = Costs.parse("5,6,4,1")
    sched = make_schedule("interleaved-1f1b", 4, 8, chunks=2, costs=costs)
    table = pack_ticks(sched, costs)
    at_once = packed_time(dataclasses.replace(table, deferred=False), costs)
    assert table.deferred and packed_time(table, costs) < at_once


@pytest.mark.parametrize("kind", ["zb-h1", "interleaved-1f1b", "zb-v"])
@pytest.mark.parametrize("order", [FORWARD_FIRST, FORWARD_LAST])
def test_the_greedy_prices_a_tick_as_the_simulator_does(kind, order):
    """The greedy picks each tick's ops by the time it thinks a worker keeps the tick
    (`GreedyPacker.worker_time`: at least C in a tick after one that made a late
    message, which lands then); packing for either timing, its ticks' longest
    such times add up to what the simulator prices the table at."""
    costs = Costs.parse("5,6,4,1")
    chunks = 2 if kind == "interleaved-1f1b" else None
    sched = compute_only(make_schedule(kind, 4, 8, chunks=chunks, costs=costs))
    for deferred in (False, True):
        greedy = GreedyPacker(sched, costs, 1, None, order=order, deferred=deferred)
        table = greedy.run("utilization")
        assert table.deferred == deferred
        made = {
            (it, key): t
            for t, tick in enumerate(table.ticks)
            for w, entries in tick.items()
            for it, op in entries
            for key in greedy.produces[(w, op)]
        }
        total = sum(
            max(
                greedy.worker_time(w, list(entries), t, made, costs.c * (t - 1 in greedy.sent_late))
                for w, entries in tick.items()
            )
            for t, tick in enumerate(table.ticks)
        )
        assert total == pytest.approx(packed_time(table, costs))


def test_packing_for_the_deferred_price_beats_choosing_a_timing_afterwards():
    """auto at P=4 m=8 under the Zero Bubble paper's costs, one greedy variant: the
    table packed with messages sent at once, then deferred if cheaper (what
    pack_ticks did before it packed for the deferred price), costs more than the
    table packed for the deferred price (144 against 155)."""
    costs = Costs.parse("5,6,4,1")
    sched = compute_only(make_schedule("auto", 4, 8, costs=costs))
    prices = [
        packed_time(
            cheaper_timing(
                GreedyPacker(sched, costs, 1, None, deferred=d).run("utilization"), costs
            ),
            costs,
        )
        for d in (False, True)
    ]
    assert prices[1] < prices[0] - 1e-9


@pytest.mark.parametrize(("kind", "P", "m"), [("1f1b", 2, 3), ("zb-h1", 3, 3), ("gpipe", 2, 3)])
def test_the_exact_engine_prices_deferred_tables_as_the_simulator(kind, P, m):
    """The MILP for deferred tables (tick_milp.py: a tick after one that made a late
    message lasts at least C, its reader starts C in) reaches, at its optimum, the
    price the simulator gives the table it returns; no greedy table beats it."""
    costs = Costs.parse("5,6,4,1")
    sched = make_schedule(kind, P, m)
    greedy = pack_ticks(sched, costs)
    start = PackedTicks.one_op_per_tick(sched)
    horizon = max(len(greedy), len(start))
    for order in (FORWARD_FIRST, FORWARD_LAST):
        found = solve_ticks(sched, costs, None, 30.0, order, horizon, start, deferred=True)
        assert found.optimal and found.table.deferred
        found.table.check()
        assert found.time == pytest.approx(packed_time(found.table, costs))
        if greedy.order == order and greedy.deferred:
            assert found.time <= packed_time(greedy, costs) + 1e-9
