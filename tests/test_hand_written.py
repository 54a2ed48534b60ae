"""Schedules the way a user may write them in the IR's text form, not only the way
the generators do: programs in any valid order, a fused or a split backward
chosen per stage and microbatch, interleaved and V layouts, replicas that step
their stages in different orders, staggered optimizers. Packed into ticks
within the schedule's own peak and without a memory bound, each compiles and
gives jax.value_and_grad's loss and gradients on the tiny model."""

from __future__ import annotations

import math
import random

import pytest
from test_lowering import check_value_and_grad
from test_passes import random_schedule

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import stagger
from pjit_pipe.tick_packing.packer import pack_ticks

# (seed, stages, microbatches, replicas, layout, staggered, costs)
CASES = [
    (100, 2, 3, 2, "interleaved", False, Costs(1, 2, 1)),
    (101, 2, 2, 2, "v", False, Costs(5, 6, 4, 1)),
    (102, 4, 3, 1, "plain", True, Costs(1, 2, 1)),
    (104, 4, 2, 2, "interleaved", False, Costs(1, 1, 1, 1)),
    (1002, 4, 2, 2, "plain", True, Costs(5, 2, 4)),
]


@pytest.mark.parametrize("mem_limit", [None, math.inf], ids=["own-peak", "unbounded"])
@pytest.mark.parametrize(("seed", "P", "m", "D", "layout", "staggered", "costs"), CASES)
def test_hand_written_schedule_matches_value_and_grad(
    seed, P, m, D, layout, staggered, costs, mem_limit
):
    sched = validate(random_schedule(random.Random(seed), P, m, D, layout))
    sched = stagger(sched) if staggered else sched
    table = pack_ticks(sched, costs, 1, mem_limit)
    table.check()
    check_value_and_grad(sched, D, P, ticks=table)


def test_some_hand_written_replicas_step_their_stages_in_different_orders():
    """What the cases above cover: replicas of a position that order two stages'
    OPTs differently (which deadlocked the packer), and both backward forms."""
    orders, kinds = set(), set()
    for seed, P, m, D, layout, _, _ in CASES:
        sched = random_schedule(random.Random(seed), P, m, D, layout)
        for p in range(P):
            steps = [
                tuple(op.stage for op in sched.program(w) if op.kind is Kind.OPT)
                for w in sched.workers
                if w.stage == p
            ]
            orders.add(len(set(steps)) > 1)
        kinds |= {op.kind for _, _, op in sched.ops()}
    assert True in orders
    assert {Kind.BW, Kind.B, Kind.W} <= kinds
