"""The lower bound on a tick table's price (simulator.bounds.lockstep_lower_bound):
no table beats it (the packer's, the unpacked one, HiGHS's proven optimum), it has
the closed form of its worked example, and the packer and the exact engine stop
at it without changing what they return."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_passes import costs, schedules

import pjit_pipe.tick_packing.packer as pack_ticks_module
from pjit_pipe.cli import main
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import LANE_ORDERS, W_PER_TICK, PackedTicks
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator.bounds import lockstep_lower_bound
from pjit_pipe.simulator.simulate import packed_time, simulate
from pjit_pipe.tick_packing.exact_table import exact_bounds
from pjit_pipe.tick_packing.packer import pack_ticks
from pjit_pipe.tick_packing.tick_milp import solve_ticks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(), costs(), st.sampled_from([0.0, 0.5]), st.sampled_from([None, 0.5, 0.9]))
def test_no_packed_table_beats_the_bound(
    schedule: Schedule, costs: Costs, tick: float, fused: float | None
) -> None:
    """Random schedules (replicas, interleaved and V layouts), costs with transfers,
    optimizer steps, a priced tick and a loss stage that may cost less fused: the
    unpacked table and the packed ones, within the own peak and unbounded, are
    valid tables and all cost at least the bound."""
    fbw = None if fused is None else fused * (costs.f + costs.b + costs.w)
    costs = Costs(costs.f, costs.b, costs.w, costs.c, costs.opt, tick=tick, fbw=fbw)
    floor = lockstep_lower_bound(schedule, costs)
    assert floor > 0
    tables = [
        PackedTicks.one_op_per_tick(schedule),
        pack_ticks(schedule, costs),
        pack_ticks(schedule, costs, mem_limit=math.inf),
    ]
    for table in tables:
        table.check()
        assert packed_time(table, costs) >= floor - 1e-9


def _milp_optimum(schedule: Schedule, costs: Costs, seconds: float) -> float | None:
    """HiGHS's proven optimum over both lane orders, without a memory bound, or None
    when it proves none in time. The MILP alone: exact_bounds itself uses the bound."""
    start = PackedTicks.one_op_per_tick(schedule)
    best = math.inf
    for order in LANE_ORDERS:
        result = solve_ticks(schedule, costs, math.inf, seconds, order, len(start), start)
        if not result.optimal:
            return None
        best = min(best, result.time)
    return best


@pytest.mark.parametrize(
    "kind, stages, microbatches, f, b, w, c",
    [
        ("1f1b", 2, 3, 1, 2, 1, 0),
        ("zb-h1", 2, 3, 1, 2, 1, 0),
        ("zb-h2", 3, 3, 1, 2, 1, 0),
        ("zb-h1", 2, 2, 5, 6, 4, 1),
        ("zb-v", 2, 2, 1, 2, 1, 0),
        ("interleaved-1f1b", 2, 2, 2, 3, 1, 1),
    ],
)
def test_the_exact_optimum_is_at_or_above_the_bound(kind, stages, microbatches, f, b, w, c):
    """Against HiGHS's proven optimum (any order the dependencies allow, any memory,
    both lane orders): the bound is at or under it."""
    costs = Costs(f, b, w, c)
    schedule = make_schedule(kind, stages, microbatches, costs=costs)
    optimum = _milp_optimum(schedule, costs, 20.0)
    assert optimum is not None, "HiGHS proves these small cases in well under a second"
    floor = lockstep_lower_bound(schedule, costs)
    assert 0 < floor <= optimum + 1e-6


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
@pytest.mark.parametrize("f, b, w", [(1, 2, 1), (5, 6, 4), (1, 1, 1), (1, 3, 1), (1, 4, 1)])
def test_split_backward_bound_is_the_last_stages_head_work_and_tail(stages, f, b, w):
    """For a schedule whose every stage runs F, B and W (zb-h1's and zb-h2's ops), no
    transfer time: the last stage waits P-1 forwards, does m(F+B+W), and after its
    last B the gradient crosses P-1 stages, a B per tick, while it has only W's
    left, W_PER_TICK a tick: (P-1)F + m(F+B+W) + (P-1) max(0, B - W_PER_TICK W),
    derived by hand."""
    costs = Costs(f, b, w, 0.0)
    for m in (stages, 2 * stages):
        tail = (stages - 1) * max(0, b - W_PER_TICK * w)
        closed = (stages - 1) * f + m * (f + b + w) + tail
        for kind in ("zb-h1", "zb-h2"):
            schedule = make_schedule(kind, stages, m, costs=costs)
            assert lockstep_lower_bound(schedule, costs) == pytest.approx(closed)


def test_a_table_at_the_bound_is_optimal_without_a_solve():
    """zb-h1 at P=4 m=8 under unit costs packs at the bound (the event-driven period,
    27): exact_bounds returns the greedy's table as proven optimal at once."""
    costs = Costs(1, 1, 1)
    schedule = make_schedule("zb-h1", 4, 8, costs=costs)
    assert lockstep_lower_bound(schedule, costs) == simulate(schedule, costs).makespan == 27
    found = exact_bounds(schedule, costs, time_limit=0.01)
    assert found.optimal and found.time == found.bound == 27
    found.table.check()


@pytest.mark.parametrize(
    "kind, stages, microbatches, costs",
    [
        ("zb-h1", 4, 8, Costs(1, 1, 1)),  # the greedy reaches the bound
        ("gpipe", 4, 8, Costs(1, 1, 1)),  # the unpacked table does
        ("zb-h1", 4, 8, Costs(5, 6, 4, 1)),  # nothing does: every variant runs
        ("zb-v", 2, 4, Costs(1, 2, 1)),
        ("gpipe", 4, 8, Costs(1, 1, 1, fbw=2.5)),  # fusion priced: no ties to break
        ("zb-h1", 4, 8, Costs(1, 1, 1, fbw=2.5)),
    ],
)
def test_stopping_at_the_bound_returns_the_same_table(
    kind, stages, microbatches, costs, monkeypatch
):
    """The packer stops trying variants once a table reaches the bound: that table is
    what the whole search keeps too (ties go to the earlier variant). Without a fused
    price, ties also go to the table that fuses more loss-stage groups (pack_ticks),
    which the whole search may find later: then the same price."""
    schedule = make_schedule(kind, stages, microbatches, costs=costs)
    monkeypatch.setattr(pack_ticks_module, "_PACKED", {})
    stopped = pack_ticks(schedule, costs)
    monkeypatch.setattr(pack_ticks_module, "_PACKED", {})
    monkeypatch.setattr(pack_ticks_module, "_FLOORS", {})  # the bound's cache too
    monkeypatch.setattr(pack_ticks_module, "lockstep_lower_bound", lambda *_: -math.inf)
    searched = pack_ticks(schedule, costs)
    assert packed_time(stopped, costs) == pytest.approx(packed_time(searched, costs))
    if stopped != searched:  # only a tie, broken toward fusion
        assert costs.fbw is None and searched.fused_groups() > stopped.fused_groups()


def test_cli_reports_the_bound_of_a_synchronous_schedule(capsys):
    """`--json` gives `lockstep_bound` next to `lockstep_period`; a staggered schedule's
    iterations overlap (its period may go below one iteration's bound), so none."""
    args = ["schedule", "zb-h2", "-P", "4", "-m", "8", "--costs", "1,3,1", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    schedule = make_schedule("zb-h2", 4, 8, costs=Costs(1, 3, 1))
    assert out["lockstep_bound"] == lockstep_lower_bound(schedule, Costs(1, 3, 1))
    assert out["lockstep_bound"] <= out["lockstep_period"]
    assert main([*args, "--stagger", "--iterations", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["lockstep_bound"] is None
