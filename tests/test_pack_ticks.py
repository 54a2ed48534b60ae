"""The packed tick table: its rule, the packing pass against the exact optimum, the
lowering's plan against the priced table, and one compiled packed program against
jax.value_and_grad of the unpipelined model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_lowering import check_value_and_grad

from pjit_pipe.cli import main
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import MemoryBound, largest_peak, split_stages
from pjit_pipe.ir.ops import BW, B, F, Kind, W, Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.serialize import from_text
from pjit_pipe.ir.ticks import FORWARD_FIRST, FORWARD_LAST, PackedTicks, fits, lane_order
from pjit_pipe.ir.validate import validate
from pjit_pipe.lowering.tick_plan import FUSED, LANE_OF, build_plan
from pjit_pipe.passes import stagger
from pjit_pipe.passes.reroute import reroute
from pjit_pipe.schedules import KINDS, make_schedule, schedule_with_failures
from pjit_pipe.simulator.simulate import packed_time, simulate
from pjit_pipe.tick_packing.exact_table import exact_bounds, exact_pack
from pjit_pipe.tick_packing.greedy import GreedyPacker
from pjit_pipe.tick_packing.packer import pack_ticks
from pjit_pipe.tick_packing.tick_milp import polish_ticks

COSTS = Costs(1, 2, 1)


def test_lane_rule():
    assert fits([F(0, 0), B(0, 0), W(0, 0)])
    assert not fits([B(0, 0), F(0, 1)])  # out of lane order
    assert not fits([F(0, 0), F(0, 1)])  # two activations
    assert not fits([B(1, 0), W(0, 0), B(0, 1)])
    assert fits([B(0, 0), W(0, 0), F(0, 1)], FORWARD_LAST)
    assert not fits([F(0, 1), B(0, 0)], FORWARD_LAST)
    assert fits([BW(0, 0), F(0, 1)], FORWARD_LAST) and not fits([BW(0, 0), F(0, 1)])
    # Two W's share the W lane (ir.ticks.W_PER_TICK); not three, not with a BW.
    assert fits([F(0, 2), B(0, 1), W(0, 0), W(0, 1)])
    assert fits([B(0, 1), W(0, 0), W(0, 1), F(0, 2)], FORWARD_LAST)
    assert not fits([F(0, 2), B(0, 1), W(0, 0), W(0, 1)], w_per_tick=1)
    assert not fits([W(0, 0), W(0, 1), W(0, 2)])
    assert not fits([BW(0, 0), W(0, 1)]) and not fits([W(0, 1), BW(0, 0)])


@pytest.mark.parametrize("kind", KINDS)
def test_packed_tables_keep_the_rule_and_beat_one_op_per_tick(kind):
    sched = make_schedule(kind, 4, 8, chunks=2 if kind == "interleaved-1f1b" else None)
    for s in (sched, stagger(sched)):
        table = pack_ticks(s, COSTS, 2)
        table.check()
        # Counted op by op in the order the ticks run them: within the own peak.
        assert max(table.peak_memory().values()) <= largest_peak(s) + 1e-9
        packed = simulate(s, COSTS, 2, mode="lockstep", ticks=table).makespan
        assert packed <= simulate(s, COSTS, 2, mode="lockstep").makespan + 1e-9


def test_rerouted_staggered_table_keeps_the_rule():
    sched = stagger(schedule_with_failures("zb-h1", 4, 8, 4, [(1, 2)], COSTS, time_limit=1.0))
    table = pack_ticks(sched, COSTS, 3, mem_limit=math.inf)  # unbounded: it runs ahead
    table.check()
    locked = simulate(sched, COSTS, 3, mode="lockstep", ticks=table).steady_period
    assert locked < simulate(sched, COSTS, 3, mode="lockstep").steady_period


def test_forward_last_packs_within_the_own_peak_where_forward_first_cannot():
    """zb-h1 at P=4 m=8 within its own peak: the B, W, F table is cheaper than every
    F, B, W table the greedy builds, and it fits the peak only because its ticks
    free before they allocate (the same ticks run F first would exceed it)."""
    sched = make_schedule("zb-h1", 4, 8)
    best = pack_ticks(sched, COSTS)
    forward_first = pack_ticks(sched, COSTS, orders=(FORWARD_FIRST,))
    assert best.order == FORWARD_LAST and forward_first.order == FORWARD_FIRST
    best.check()
    assert packed_time(best, COSTS) < packed_time(forward_first, COSTS)
    own = largest_peak(sched)
    assert max(best.peak_memory().values()) <= own
    reordered = PackedTicks(
        sched,
        1,
        tuple(
            {
                w: (
                    *lane_order([e for e in es if e[1].kind is not Kind.OPT]),
                    *(e for e in es if e[1].kind is Kind.OPT),
                )
                for w, es in tick.items()
            }
            for tick in best.ticks
        ),
        FORWARD_FIRST,
    )
    reordered.check()  # a valid F, B, W table (no B, W, F tick feeds itself)...
    assert max(reordered.peak_memory().values()) > own  # ...that peaks above the limit


def test_check_rejects_a_message_used_in_its_own_tick():
    sched = make_schedule("1f1b", 2, 2)
    table = pack_ticks(sched, COSTS)
    ticks = [dict(t) for t in table.ticks]
    # Move F1.0 (worker 1) into the tick of F0.0, which makes its input.
    (t1,) = [t for t, tick in enumerate(ticks) if (0, F(1, 0)) in tick.get(Worker(0, 1), ())]
    ticks[t1] = {w: es for w, es in ticks[t1].items() if w != Worker(0, 1)} | {
        Worker(0, 1): tuple(e for e in ticks[t1][Worker(0, 1)] if e != (0, F(1, 0)))
    }
    ticks[0] = {**ticks[0], Worker(0, 1): ((0, F(1, 0)),)}
    bad = PackedTicks(sched, 1, tuple({w: es for w, es in t.items() if es} for t in ticks))
    with pytest.raises(ScheduleError, match="needs"):
        bad.check()


@pytest.mark.parametrize(
    "kind, P, m, costs",
    [
        ("1f1b", 2, 3, "1,2,1,0"),
        ("1f1b", 2, 3, "5,6,4,1"),
        ("interleaved-1f1b", 2, 2, "5,6,4,1"),
        ("zb-v", 2, 2, "1,1,1,0"),
        ("zb-h1", 2, 2, "5,6,4,1"),
    ],
)
def test_greedy_is_close_to_the_exact_optimum(kind, P, m, costs):
    costs = Costs.parse(costs)
    sched = make_schedule(kind, P, m, chunks=2 if kind == "interleaved-1f1b" else None)
    best = exact_pack(sched, costs)
    best.check()
    # The optimum is over both send timings where C > 0 (tick_packing/send_timing.py).
    greedy = packed_time(pack_ticks(sched, costs), costs)
    optimum = packed_time(best, costs)
    assert optimum - 1e-9 <= greedy <= 1.03 * optimum


def _ops_by_tick(table: PackedTicks, index: dict[Worker, int]) -> set:
    m = table.schedule.microbatches
    return {
        (index[w], t, LANE_OF[op.kind], op.kind, op.stage, it * m + op.mb, op.replica)
        for t, tick in enumerate(table.ticks)
        for w, es in tick.items()
        for it, op in es
        if op.kind is not Kind.OPT
    }


@pytest.mark.parametrize("case", ["rerouted-1f1b", "zb-h2-two-ws", "fused-1f1b"])
def test_lowering_plan_runs_the_priced_table(case):
    """Tick by tick, each device's lanes hold exactly the table's ops, and the
    optimizer steps follow the table's OPTs (a re-routed, staggered, 2-iteration table;
    a table whose ticks hold two W's of a worker, the second in the lane `w2`; a
    table whose last stage's F and BW share ticks, each pair run as one FUSED op in
    the W lane, which stands for both)."""
    costs = Costs(1, 2, 1, fbw=3) if case == "fused-1f1b" else COSTS
    if case == "rerouted-1f1b":
        sched = stagger(schedule_with_failures("1f1b", 2, 4, 2, [(1, 0)], COSTS, time_limit=1.0))
    elif case == "fused-1f1b":
        sched = make_schedule("1f1b", 4, 4)
    else:
        sched = make_schedule("zb-h2", 4, 4, costs=COSTS)
    m = sched.microbatches
    table = pack_ticks(sched, costs, 2)
    devices = tuple(sched.alive_workers)
    plan = build_plan(table, False, devices, fuse_loss=True)
    assert plan.ticks == len(table.ticks)
    assert np.any(plan.rows.w2.branch) == (case == "zb-h2-two-ws")
    assert any(kind == FUSED for kind, _ in plan.branches) == (case == "fused-1f1b")
    planned = set()
    for lane in ("f", "b", "w", "w2"):
        rows = getattr(plan.rows, lane)
        for d, t in zip(*np.nonzero(rows.branch), strict=True):
            kind, stage = plan.branches[rows.branch[d, t] - 1]
            it, r, j = plan.inputs[d, rows.mb[d, t]]
            at = (int(d), int(t))
            mb = (stage, int(it) * m + int(j), int(r))
            if kind == FUSED:  # 1F1B's last stage: its F and BW
                planned |= {(*at, "f", Kind.F, *mb), (*at, "w", Kind.BW, *mb)}
            else:
                planned.add((*at, lane[0], kind, *mb))
    index = {w: i for i, w in enumerate(devices)}
    # The input list names each op's microbatch only for the stages that read inputs.
    reads = {e for e in _ops_by_tick(table, index) if e[4] in (0, sched.num_virtual_stages - 1)}
    assert {e for e in planned if e[4] in (0, sched.num_virtual_stages - 1)} == reads
    assert {e[:5] for e in planned} == {e[:5] for e in _ops_by_tick(table, index)}
    opt_ticks = {
        t
        for t, tick in enumerate(table.ticks)
        for es in tick.values()
        for _, o in es
        if o.kind is Kind.OPT
    }
    assert set(np.nonzero(plan.updates)[0]) == opt_ticks


def test_cli_reports_the_lockstep_period(capsys):
    args = ["schedule", "zb-h1", "-P", "4", "-m", "8", "--costs", "1,2,1", "--iterations", "3"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sched = make_schedule("zb-h1", 4, 8, costs=COSTS)
    table = pack_ticks(sched, COSTS, 3)
    want = simulate(sched, COSTS, 3, mode="lockstep", ticks=table).steady_period
    assert out["lockstep_period"] == pytest.approx(want)
    assert out["steady_period"] <= out["lockstep_period"]
    # --polish: the table pack_ticks(..., polish=) gives, priced the same way.
    args = ["schedule", "zb-h2", "-P", "4", "-m", "6", "--costs", "1,2,1", "--json"]
    assert main([*args, "--polish", "1"]) == 0
    polished = json.loads(capsys.readouterr().out)["lockstep_period"]
    sched = make_schedule("zb-h2", 4, 6, costs=COSTS)
    table = pack_ticks(sched, COSTS, 4, polish=1.0)
    assert polished == pytest.approx(
        simulate(sched, COSTS, 4, mode="lockstep", ticks=table).steady_period
    )
    assert (
        polished
        < simulate(
            sched, COSTS, 4, mode="lockstep", ticks=pack_ticks(sched, COSTS, 4)
        ).steady_period
    )


def test_packed_zb_h1_matches_unpipelined():
    """A packed table with F, B and W of one device in one tick (the greedy's
    longest-tick variant packs most)."""
    sched = make_schedule("zb-h1", 4, 4)
    table = GreedyPacker(sched, COSTS, 1, None).run("longest")
    table.check()
    busiest = max(
        sum(op.kind is not Kind.OPT for _, op in es) for tick in table.ticks for es in tick.values()
    )
    assert busiest == 3
    check_value_and_grad(sched, 1, 4, ticks=table)


def test_polished_table_is_faster_valid_and_matches_unpipelined():
    """Exact solves of windows of ticks (`pack_ticks(..., polish=)`) find what the
    greedy misses; the table they give may run a worker's microbatches in another
    order, and the compiled program still gives jax.value_and_grad's numbers."""
    sched = make_schedule("zb-h2", 4, 6)
    greedy = pack_ticks(sched, COSTS)
    table = pack_ticks(sched, COSTS, polish=2.0)
    table.check()
    assert max(table.peak_memory().values()) <= largest_peak(sched) + 1e-9
    assert packed_time(table, COSTS) < packed_time(greedy, COSTS)
    check_value_and_grad(sched, 1, 4, ticks=table)


@pytest.mark.parametrize("width", [2, 5, 100])
def test_polish_stays_between_the_optimum_and_the_greedy(width):
    sched = make_schedule("1f1b", 2, 3)
    costs = Costs.parse("5,6,4,1")
    greedy = pack_ticks(sched, costs)
    polished = polish_ticks(greedy, costs, width=width)
    polished.check()
    best = exact_pack(sched, costs)  # over both send timings
    price = packed_time(polished, costs)
    assert packed_time(best, costs) - 1e-9 <= price <= packed_time(greedy, costs) + 1e-9
    if width >= len(greedy):
        # One window holds the whole table: the optimum of the polished table's
        # timing (a window keeps its table's timing; the greedy's here: deferred).
        assert polished.deferred == greedy.deferred == best.deferred
        assert price <= packed_time(best, costs) + 1e-9


def pool_rows(table: PackedTicks) -> tuple[int, int]:
    """The (B-pool, W-pool) rows the lowering's slot allocator sizes for `table`."""
    sched = table.schedule
    plan = build_plan(table, False, tuple(sched.alive_workers), split=split_stages(sched))
    return plan.bres_slots, plan.res_slots


@pytest.mark.parametrize(
    "kind, costs, polish",
    [
        ("zb-h1", "1,2,1,0", 0.0),
        ("zb-h2", "1,2,1,0", 0.0),
        ("zb-h2", "5,6,4,1", 0.0),
        ("auto", "1,2,1,0", 0.0),
        pytest.param("zb-h2", "5,6,4,1", 1.0, marks=pytest.mark.slow),
    ],
)
def test_packed_tables_need_no_more_residual_rows_than_the_schedule(kind, costs, polish):
    """Units alone let a table keep the schedule's peak while one residual pool holds
    a row more (each of these tables did, packed in units only): the default bound
    holds each pool to the schedule's own peak too, in the greedy and the MILP."""
    costs = Costs.parse(costs)
    sched = make_schedule(kind, 4, 8, costs=costs if kind == "auto" else None)
    unpacked = pool_rows(PackedTicks.one_op_per_tick(sched))
    # The packer's model of the pools is the allocator's on the unpacked table.
    assert MemoryBound.of(sched, None).rows == unpacked
    rows = pool_rows(pack_ticks(sched, costs, polish=polish))
    assert rows[0] <= unpacked[0] and rows[1] <= unpacked[1]


def test_polish_refuses_bad_input_and_keeps_staggered_tables_valid():
    with pytest.raises(ScheduleError, match="polish must be a number of seconds"):
        pack_ticks(make_schedule("1f1b", 2, 2), COSTS, polish=-1)
    asynchronous = make_schedule("async-1f1b", 2, 4)
    with pytest.raises(ValueError, match="not asynchronous"):
        polish_ticks(pack_ticks(asynchronous, COSTS), COSTS)
    # A staggered schedule: its polished iteration, repeated, or the greedy's table.
    staggered = stagger(make_schedule("zb-h2", 4, 4))
    table = pack_ticks(staggered, COSTS, 2, polish=1.0)
    table.check()
    assert packed_time(table, COSTS) <= packed_time(pack_ticks(staggered, COSTS, 2), COSTS)


def _forward_ticks(table: PackedTicks, worker: Worker) -> list[int]:
    return [
        t
        for t, tick in enumerate(table.ticks)
        for _, op in tick.get(worker, ())
        if op.kind is Kind.F
    ]


def test_1f1b_in_its_own_peak_runs_at_most_P_forwards_in_2P_minus_1_ticks():
    """The structural limit of 1F1B within its own peak (P microbatches on stage 0):
    a microbatch's F0 -> F1 -> ... -> BW(P-1) -> ... -> BW0 round trip spans at least
    2P-1 ticks (every message costs a tick), and each one is in flight on stage 0
    for all of them, so stage 0 runs at most P forwards in any 2P-1 consecutive ticks.
    Checked on the exact optimum (which the greedy matches here); unbounded, the
    optimum breaks it and is faster."""
    P, sched = 2, make_schedule("1f1b", 2, 3)
    best = exact_pack(sched, COSTS)
    for table in (best, pack_ticks(sched, COSTS)):
        f = _forward_ticks(table, Worker(0, 0))
        assert all(f[a + P] - f[a] >= 2 * P - 1 for a in range(len(f) - P))
    assert packed_time(pack_ticks(sched, COSTS), COSTS) == pytest.approx(packed_time(best, COSTS))
    free = exact_pack(sched, COSTS, math.inf)
    f = _forward_ticks(free, Worker(0, 0))
    assert any(f[a + P] - f[a] < 2 * P - 1 for a in range(len(f) - P))
    # Own peak 17 against 16 unbounded (= the event-driven makespan): 1.0625, over 1.05.
    assert packed_time(best, COSTS) == pytest.approx(17)
    assert packed_time(free, COSTS) == pytest.approx(simulate(sched, COSTS).makespan) == 16


def test_exact_optimum_prices_each_tick():
    """With `Costs.tick` the MILP pays it per tick that holds an op, as `packed_time`
    prices a table: its optimum then beats the tick-free optimum's table, priced the
    same way, and the greedy stays at or above it."""
    sched = make_schedule("1f1b", 2, 3)
    dear = Costs(1, 2, 1, tick=1.0)
    best = exact_bounds(sched, dear)
    assert best.optimal
    best.table.check()
    assert best.time == pytest.approx(packed_time(best.table, dear))
    tick_free = exact_pack(sched, COSTS)
    assert best.time < packed_time(tick_free, dear) - 1e-6
    assert packed_time(pack_ticks(sched, dear), dear) >= best.time - 1e-6


def test_exact_bounds_bracket_the_optimum():
    """Stopped early, HiGHS still returns a valid table no slower than the greedy's
    (its first solution) and a lower bound under it."""
    sched = make_schedule("zb-h1", 3, 4)
    greedy = packed_time(pack_ticks(sched, COSTS), COSTS)
    found = exact_bounds(sched, COSTS, time_limit=1.0)
    found.table.check()
    assert found.bound - 1e-6 <= found.time == pytest.approx(packed_time(found.table, COSTS))
    assert found.time <= greedy + 1e-9


def test_staggering_pays_in_a_rerouted_table():
    """A re-routed schedule comes staggered; the same programs with the iteration
    barrier (its synchronous form: each OPT is its worker's last op) run slower
    once packed."""
    staggered = reroute(make_schedule("zb-h1", 2, 2, replicas=2), [(1, 1)], COSTS)
    sync = staggered.replace(staggered=False, kind="zb-h1+reroute")
    steady = []
    for sched in (sync, staggered):
        table = pack_ticks(sched, COSTS, 3, math.inf)
        table.check()
        steady.append(simulate(sched, COSTS, 3, mode="lockstep", ticks=table).steady_period)
    assert steady[1] < steady[0]


def test_packs_replicas_that_step_their_stages_in_different_orders():
    """Replica 0's worker at position 1 steps stage 3, then runs stage 1's backward
    and steps it; replica 1's steps stage 1, then 3. Each stage's OPTs share a tick
    (one reduction), so the packer takes a worker's run of OPTs in any order (it
    used to deadlock, as in 82 of 300 random interleaved schedules)."""
    sched = from_text(
        "schedule kind=hand stages=2 chunks=2 microbatches=1 replicas=2 layout=0,1,0,1"
        " staggered=0 failed=-\n"
        "0:0 | F0.0 F2.0 B2.0 W2.0 BW0.0 OPT0 OPT2\n"
        "0:1 | F1.0 F3.0 BW3.0 OPT3 B1.0 W1.0 OPT1\n"
        "1:0 | F0.0 F2.0 B2.0 W2.0 B0.0 W0.0 OPT2 OPT0\n"
        "1:1 | F1.0 F3.0 B3.0 B1.0 W3.0 W1.0 OPT1 OPT3\n"
    )
    validate(sched)
    for mem_limit in (None, math.inf):
        table = pack_ticks(sched, COSTS, mem_limit=mem_limit)
        table.check()
        assert packed_time(table, COSTS) <= simulate(sched, COSTS, mode="lockstep").makespan


@pytest.mark.parametrize("kind", ["zb-h2", "auto", "zb-v"])
def test_more_memory_never_packs_slower(kind):
    """A table within the own peak is a table of any looser limit too, so pack_ticks
    offers it there (the greedy alone gave auto P=4 m=8 1,2,1 38 unbounded, 37 at
    the own peak)."""
    for costs in (COSTS, Costs.parse("5,6,4,1")):
        sched = make_schedule(kind, 4, 8, costs=costs)
        own = packed_time(pack_ticks(sched, costs), costs)
        for limit in (largest_peak(sched) + 1, math.inf):
            assert packed_time(pack_ticks(sched, costs, mem_limit=limit), costs) <= own + 1e-9
