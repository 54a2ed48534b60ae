"""Every evaluator and list scheduler times ops exactly as the execution engine does.

The engine (`pjit_pipe.ir.engine`) states the dependency rules once; the fast
per-replica evaluator (`schedules.timing`), the greedy list scheduler behind
auto and zb-v (`schedules.heuristic`), the re-routing list scheduler
(`passes.list_scheduler`) and defer_w's replay each keep their own loop for
speed or for their policy. Here each one's times are compared with the
engine's run of the programs it produced, on random valid schedules of every
layout, fused or split backward, staggered or not, re-routed or not.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_passes import schedules

from pjit_pipe.ir import Costs, Schedule, Worker
from pjit_pipe.ir.engine import (
    AllOpts,
    Engine,
    Message,
    MicrobatchGrads,
    Received,
    StageGrads,
    Tensor,
)
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.ops import Payload
from pjit_pipe.ir.schedule import interleaved_layout, v_layout
from pjit_pipe.passes import split_backward, stagger
from pjit_pipe.passes.defer_w import replay
from pjit_pipe.passes.list_scheduler import ListScheduler, priorities
from pjit_pipe.passes.reroute import assign
from pjit_pipe.schedules import KINDS, make_schedule
from pjit_pipe.schedules.common import replicated
from pjit_pipe.schedules.heuristic import Policy, greedy
from pjit_pipe.schedules.timing import Shape, Step, evaluate, to_ops
from pjit_pipe.simulator import simulate

FEW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
Times = dict[Worker, list[tuple[float, float]]]


def costs_for(stages: int):
    """Uneven per-stage costs, a transfer time and an optimizer time."""
    per_stage = st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0]), min_size=stages, max_size=stages)
    return st.builds(
        Costs,
        per_stage,
        per_stage,
        per_stage,
        st.sampled_from([0.0, 0.25, 1.0]),
        st.sampled_from([0.0, 0.5]),
    )


def engine_times(schedule: Schedule, costs: Costs, iteration: int = 0) -> Times:
    """(start, end) of each op of one iteration, per worker in program order, by the engine."""
    events = Engine(schedule).run(
        costs.duration_fn(schedule), lambda a, b: costs.c, iterations=iteration + 1
    )
    out: Times = {w: [] for w in schedule.alive_workers}
    for e in sorted(events, key=lambda e: (e.worker, e.index)):
        if e.iteration == iteration:
            out[e.worker].append((e.start, e.end))
    return out


def assert_same_times(got: Times, expected: Times) -> None:
    assert got.keys() == expected.keys()
    for w in expected:
        flat = [t for pair in expected[w] for t in pair]
        assert [t for pair in got[w] for t in pair] == pytest.approx(flat, rel=1e-12, abs=1e-12), w


def test_key_kinds_never_compare_equal() -> None:
    """Keys are NamedTuples, equal to any tuple of the same fields: each kind has its own
    number of fields, so a Message and a Received of the same tensor stay distinct."""
    t = Tensor(Payload.ACT, 1, 0, 0)
    keys = [t, Message(t, Worker(0, 0), Worker(0, 1)), Received(t, Worker(0, 1)), StageGrads(1)]
    keys.append(AllOpts())
    assert len({len(k) for k in keys}) == len(keys)
    assert len(set(keys)) == len(keys)
    # an asynchronous OPT's key has Received's field count, but ints where it has tuples
    per_mb = MicrobatchGrads(1, 0)
    assert per_mb not in keys and len(set(keys) | {per_mb}) == len(keys) + 1


@FEW
@given(st.data())
def test_fast_evaluator_prices_like_the_engine(data) -> None:
    """schedules.timing.evaluate (one replica, OPTs appended) against the engine."""
    sched = data.draw(schedules())
    costs = data.draw(costs_for(sched.stages))
    positions = range(sched.stages)
    steps = [
        [Step(op.kind, op.stage, op.mb) for op in sched.program(Worker(0, p)) if op.kind != "OPT"]
        for p in positions
    ]
    shape = Shape.of(sched.stages, sched.chunks, sched.microbatches, sched.layout, costs)
    timing = evaluate(shape, steps)
    one = replicated(
        "random",
        sched.stages,
        sched.microbatches,
        1,
        lambda p, r: to_ops(steps[p], r),
        sched.chunks,
        sched.layout,
    )
    result = simulate(one, costs)  # replica 0's programs, the OPTs moved to the end
    assert timing.makespan == pytest.approx(result.makespan, rel=1e-12)
    assert timing.span == pytest.approx(result.span, rel=1e-12)


@FEW
@given(
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from(["plain", "interleaved", "v"]),
    st.sampled_from([None, 1.0, 1.5, 3.0]),
    st.booleans(),
    st.sampled_from(["eager", "fit"]),
    st.data(),
)
def test_greedy_list_scheduler_prices_like_the_engine(
    P, m, layout_kind, limit, reserve, fill, data
):
    v = 1 if layout_kind == "plain" else 2
    layout = v_layout(P) if layout_kind == "v" else interleaved_layout(P, v)
    costs = data.draw(costs_for(P))
    shape = Shape.of(P, v, m, layout, costs)
    caps = data.draw(st.none() | st.lists(st.integers(1, 2 * P), min_size=P, max_size=P))
    plan = greedy(shape, limit, Policy(None if caps is None else tuple(caps), fill, reserve))
    if plan is None:
        return  # the policy deadlocked (possible only without reservation)
    sched = replicated(
        "greedy", P, m, 1, lambda p, r: to_ops(plan.programs[p], r), v, tuple(layout)
    )
    result = simulate(sched, costs)
    assert plan.timing.makespan == pytest.approx(result.makespan, rel=1e-12)
    assert plan.timing.span == pytest.approx(result.span, rel=1e-12)


@FEW
@given(st.data(), st.sampled_from(["fit", "eager"]), st.sampled_from([None, 1.0, 2.0]))
def test_defer_w_replay_times_ops_like_the_engine(data, rule, limit) -> None:
    sched = data.draw(schedules())
    costs = data.draw(costs_for(sched.stages))
    out, times = replay(split_backward(sched), costs, limit, rule)
    assert_same_times(times, engine_times(out, costs))


@FEW
@given(  # async-1f1b is not re-routed (schedules.failure_aware refuses it)
    st.sampled_from([k for k in KINDS if k not in ("auto", "async-1f1b")]),
    st.integers(2, 3),
    st.integers(1, 4),
    st.sampled_from([(), ((0, 1),), ((1, 0),)]),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["interleave", "last", "first"]),
    st.data(),
)
def test_rerouting_list_scheduler_times_ops_like_the_engine(
    kind, P, m, failed, split, staggered, order, data
) -> None:
    """The first iteration of the re-routing list scheduler, re-routed or not, fused or
    split, staggered or behind the iteration barrier."""
    costs = data.draw(costs_for(P))
    m = m * P if kind == "interleaved-1f1b" else m
    base = make_schedule(kind, P, m, replicas=2, costs=costs)
    pattern = FailurePattern.of(2, P, failed)
    placement = assign(base, pattern)
    fkey, bkey = priorities(base, placement, order)
    caps = dict.fromkeys(base.workers, None)
    sched = ListScheduler(
        base, pattern, placement, fkey, bkey, costs, caps, split, staggered, reserve=True
    )
    programs = sched.run(2)
    first = base.replace(programs=programs[0], failed=pattern.failed, staggered=staggered)
    assert_same_times(sched.times[0], engine_times(first, costs))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "auto"])
def test_every_kind_staggered_keeps_its_work_and_the_fast_price(kind: str) -> None:
    """Each fixed kind: the engine and the fast evaluator agree; staggering only moves OPTs,
    so with free OPTs the first iteration's makespan is unchanged, and later iterations
    (no barrier) come no later than behind the barrier."""
    P, m = 3, 6
    costs = Costs([1.0, 2.0, 1.5], 1.0, [0.5, 1.0, 0.5], c=0.25)
    sched = make_schedule(kind, P, m, costs=costs)
    steps = [
        [Step(op.kind, op.stage, op.mb) for op in sched.program(Worker(0, p)) if op.kind != "OPT"]
        for p in range(P)
    ]
    shape = Shape.of(P, sched.chunks, m, sched.layout, costs)
    assert evaluate(shape, steps).makespan == pytest.approx(simulate(sched, costs).makespan)
    staggered = stagger(sched)
    assert simulate(staggered, costs).makespan == pytest.approx(simulate(sched, costs).makespan)
    steady = simulate(staggered, costs, iterations=3).steady_period
    assert steady <= simulate(sched, costs, iterations=3).steady_period + 1e-9
