"""Message routes (lowering/comms/routes.py): the fewest ppermutes that carry a channel."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np

from pjit_pipe.ir.costs import Costs
from pjit_pipe.lowering.comms.routes import degree, fewest_routes
from pjit_pipe.lowering.tick_plan import build_plan
from pjit_pipe.schedules import schedule_with_failures
from pjit_pipe.tick_packing.packer import pack_ticks


def assert_partial_permutations(routes, pairs):
    assert sorted(p for r in routes for p in r) == sorted(set(pairs))  # each pair once
    for r in routes:
        assert max(Counter(s for s, _ in r).values()) == 1  # nobody sends twice
        assert max(Counter(d for _, d in r).values()) == 1  # nobody receives twice


def test_random_pair_sets_take_as_many_routes_as_the_busiest_device():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 16)
        pairs = {(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 3 * n))}
        routes = fewest_routes(pairs)
        assert_partial_permutations(routes, pairs)
        busiest = max(
            max(Counter(s for s, _ in pairs).values()), max(Counter(d for _, d in pairs).values())
        )
        assert len(routes) == busiest == degree(pairs)


def test_a_grouping_that_is_already_fewest_is_kept():
    """Fault-free stage shifts: device i -> i+1 and the wrap of a V layout's return."""
    forward = [(0, 1), (1, 2), (2, 3)]
    back = [(3, 2), (2, 1)]
    assert fewest_routes(forward + back, [forward, back]) == [tuple(forward), tuple(sorted(back))]


def test_a_grouping_with_more_routes_than_needed_is_merged():
    # Grid shifts of a re-routed 2-replica pipeline: the shift groups are 3, one
    # device talks to at most 2 peers.
    by_shift = [[(0, 1), (2, 3)], [(0, 3)], [(2, 1)]]
    routes = fewest_routes([p for g in by_shift for p in g], by_shift)
    assert len(routes) == 2
    assert_partial_permutations(routes, [p for g in by_shift for p in g])


def test_rerouted_plan_runs_every_used_ppermute_in_its_tick():
    """A re-routed 4x4 variant: each channel takes the fewest ppermutes (3, where
    grid shifts took 4), every receive's ppermute runs in that tick, and skipping
    the idle ones leaves at most half of them."""
    costs = Costs.parse("1,2,1,0")
    sched = schedule_with_failures("zb-h1", 4, 8, 4, [(1, 2)], costs, time_limit=1.0)
    plan = build_plan(pack_ticks(sched, costs), False, tuple(sched.alive_workers))
    K, T = plan.msg_slots, plan.ticks
    for k, (shifts, recv) in enumerate(
        ((plan.act_shifts, plan.rows.recv_act), (plan.grad_shifts, plan.rows.recv_grad))
    ):
        pairs = [p for _, route in shifts for p in route]
        assert len(shifts) == degree(pairs) < len({g for label, _ in shifts for g in label})
        assert_partial_permutations([route for _, route in shifts], pairs)
        for d, t, i in zip(*np.nonzero(recv < K), strict=True):
            assert i in plan.sends[plan.rows.sends[d, t]][k]
    assert np.all(plan.rows.sends == plan.rows.sends[0])  # the same set on every device
    run = sum(len(a) + len(g) for a, g in (plan.sends[i] for i in plan.rows.sends[0]))
    assert 2 * run <= T * (len(plan.act_shifts) + len(plan.grad_shifts))
