"""Message routes (lowering/comms/routes.py): the fewest ppermutes that carry a channel."""

from __future__ import annotations

import random
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjit_pipe as pp
from pjit_pipe.ir.costs import Costs
from pjit_pipe.lowering.comms.routes import degree, fewest_routes, without_cycles
from pjit_pipe.lowering.tick_plan import build_plan
from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.schedules import schedule_with_failures
from pjit_pipe.tick_packing.packer import pack_ticks
from tests.numerics import rel_err
from tests.test_emulate import has_cycle


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


def test_wrap_edges_of_two_routes_that_share_a_device_travel_apart():
    """Device 2 tops a cycle in both routes: its two wrap edges cannot share a
    ppermute (a re-routed interleaved-1f1b on 2x2 built exactly that one)."""
    routes = [((0, 2), (2, 0)), ((1, 2), (2, 1))]
    out = without_cycles(routes)
    assert_partial_permutations(out, [p for r in routes for p in r])
    assert not any(has_cycle(r) for r in out)


def test_random_routes_lose_their_cycles_and_stay_partial_permutations():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(2, 10)
        pairs = {(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 3 * n))}
        pairs = {(s, d) for s, d in pairs if s != d}
        if not pairs:
            continue
        out = without_cycles(fewest_routes(pairs))
        assert_partial_permutations(out, pairs)
        assert not any(has_cycle(r) for r in out)


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


@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-v"])
def test_two_chunk_kinds_rerouted_on_2x2_give_plain_gradients(kind):
    """A re-routed 2-chunk plan on 2x2 (few microbatches) has two cycles topped by
    one device; its step compiles and its gradient is plain JAX's."""
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jnp.sin(x[:, :8])
    model = ResidualMLP(n_layers=4)
    params = model.init(jax.random.key(0), x)
    pm = pp.pipeline(
        model, stages=2, microbatches=2, schedule=kind, chunks=2, mesh=pp.make_mesh(data=2, stage=2)
    )
    loss, grads = pm.with_failures([(0, 1)]).value_and_grad(mse_loss)(params, x, y)
    want_loss, want = jax.value_and_grad(lambda p: mse_loss(model.apply(p, x), y))(params)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert rel_err(grads, want) <= 1e-5
