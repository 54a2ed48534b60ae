"""Schedule generators: published figures, closed forms, properties and errors.

Every figure is measured with the simulator (pjit_pipe.simulator.simulate),
not with the generators' own internal timing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjit_pipe.ir import Costs, Kind, ScheduleError, Worker, validate
from pjit_pipe.ir.serialize import from_json, from_text, to_json, to_text
from pjit_pipe.schedules import KINDS, make_schedule
from pjit_pipe.schedules.heuristic import Policy, greedy
from pjit_pipe.schedules.timing import Shape, Step, evaluate
from pjit_pipe.simulator import simulate

ZB = Costs(5, 6, 4, 1)


def measured(kind: str, P: int, m: int, costs: Costs | None = None, limit=None, **kw):
    schedule = make_schedule(kind, P, m, costs=costs, mem_limit=limit, **kw)
    validate(schedule, limit)
    return schedule, simulate(schedule, costs)


def peak(result) -> float:
    return max(result.peak_memory.values())


# --- published figures (docs/design.md section 6) -------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_classic_unit_figures(kind):
    _, r = measured(kind, 4, 8)
    assert r.makespan == 33  # (m + P - 1)(F + B + W)


def test_zb_h1_unit():
    _, r = measured("zb-h1", 4, 8, limit=4)
    assert r.makespan <= 27 and peak(r) <= 4


def test_zb_h2_unit():
    _, r = measured("zb-h2", 4, 8, limit=8)
    assert r.span == 24 and peak(r) <= 8


def test_interleaved_unit():
    s, r = measured("interleaved-1f1b", 4, 8, chunks=2)
    assert s.chunks == 2 and r.makespan <= 28.5


def test_zb_v_unit():
    s, r = measured("zb-v", 4, 8, limit=4)
    assert s.chunks == 2 and r.span == 24 and r.makespan <= 25.5 and peak(r) <= 4


@pytest.mark.parametrize(
    "P, m, limit_factor, figure, bound",
    [(4, 12, 1, "makespan", 213), (4, 12, 2, "span", 184), (8, 32, 1, "makespan", 557)],
)
def test_auto_published(P, m, limit_factor, figure, bound):
    _, r = measured("auto", P, m, ZB, limit_factor * P)
    assert getattr(r, figure) <= bound and peak(r) <= limit_factor * P


def test_auto_published_large_span():
    _, r = measured("auto", 8, 32, ZB, 16, objective="span")
    assert r.span <= 496 and peak(r) <= 16


# --- closed forms -----------------------------------------------------------------------


@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (3, 2, 1), (2, 3, 2)])
@pytest.mark.parametrize("P, m", [(3, 5), (4, 8), (6, 9)])
def test_zb_h1_closed_form(P, m, f, b, w):
    """With C=0 and W <= min(F, B), ZB-H1's only bubble is (P-1)(F+B-W)."""
    _, r = measured("zb-h1", P, m, Costs(f, b, w), limit=P)
    assert r.makespan == m * (f + b + w) + (P - 1) * (f + b - w)


@pytest.mark.parametrize("P, v", [(2, 2), (4, 2), (4, 3)])
def test_interleaved_closed_form(P, v):
    """Megatron's interleaving divides 1F1B's start-up bubble by v (unit costs, C=0)."""
    m = 2 * P
    _, r = measured("interleaved-1f1b", P, m, chunks=v)
    assert r.makespan == pytest.approx(3 * m + 3 * (P - 1) / v)


@pytest.mark.parametrize("P", [2, 3, 5])
def test_zb_h2_bubble_free_span(P):
    _, r = measured("zb-h2", P, 3 * P)
    assert r.span == 3 * 3 * P and peak(r) <= 2 * P


# --- auto never loses to the fixed kinds ------------------------------------------------


@pytest.mark.parametrize("costs", [Costs(), ZB, Costs([1, 2, 1, 3], [2, 2, 1, 3], 1, 0.5)])
@pytest.mark.parametrize("P, m", [(4, 4), (4, 9), (4, 16)])
@pytest.mark.parametrize("limit", [4, 6, None])
def test_auto_never_worse(costs, P, m, limit):
    _, best = measured("auto", P, m, costs, limit)
    for kind in ("1f1b", "zb-h1"):
        try:
            _, r = measured(kind, P, m, costs, limit)
        except ScheduleError:
            continue  # does not fit the limit
        assert best.makespan <= r.makespan + 1e-9


def test_auto_two_chunks_not_worse_than_zb_v():
    _, r = measured("auto", 4, 8, limit=4, chunks=2)
    _, zbv = measured("zb-v", 4, 8, limit=4)
    assert r.makespan <= zbv.makespan


# --- the fast internal timing agrees with the simulator ---------------------------------


def _steps(schedule, p):
    return [
        Step(op.kind, op.stage, op.mb)
        for op in schedule.program(Worker(0, p))
        if op.kind is not Kind.OPT
    ]


costs_st = st.builds(
    lambda P, fs, bs, ws, c, opt: (P, Costs(fs[:P], bs[:P], ws[:P], c, opt)),
    st.integers(1, 5),
    st.lists(st.integers(0, 6), min_size=5, max_size=5),
    st.lists(st.integers(0, 6), min_size=5, max_size=5),
    st.lists(st.integers(0, 6), min_size=5, max_size=5),
    st.sampled_from([0, 0.5, 2]),
    st.sampled_from([0, 1]),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pc=costs_st, m=st.integers(1, 10), chunks=st.sampled_from([1, 2]), data=st.data())
def test_engine_and_evaluator_match_simulator(pc, m, chunks, data):
    P, costs = pc
    layouts = [tuple(s % P for s in range(P * chunks))]
    if chunks == 2:
        layouts.append(tuple(list(range(P)) + list(reversed(range(P)))))
    layout = data.draw(st.sampled_from(layouts))
    limit = data.draw(st.sampled_from([1, P, 2 * P, None]))
    policy = Policy(
        data.draw(st.sampled_from([None, (1,) * P])), data.draw(st.sampled_from(["eager", "fit"]))
    )
    shape = Shape.of(P, chunks, m, layout, costs)
    plan = greedy(shape, limit, policy)
    schedule = make_schedule("auto", P, m, chunks, costs, limit)
    r = simulate(schedule, costs)
    t = evaluate(
        Shape.of(P, chunks, m, schedule.layout, costs), [_steps(schedule, p) for p in range(P)]
    )
    assert t.makespan == pytest.approx(r.makespan) and t.span == pytest.approx(r.span)
    # The engine's own times are the simulator's for its programs too.
    ev = evaluate(shape, plan.programs)
    assert plan.timing.makespan == pytest.approx(ev.makespan)
    assert plan.timing.span == pytest.approx(ev.span)


# --- properties of every generator ------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pc=costs_st,
    m=st.integers(1, 10),
    kind=st.sampled_from(KINDS),
    limit_factor=st.sampled_from([None, 1.0, 1.5, 2.0]),
    chunks=st.sampled_from([None, 2, 3]),
    replicas=st.integers(1, 2),
)
def test_every_schedule_is_valid(pc, m, kind, limit_factor, chunks, replicas):
    P, costs = pc
    limit = None if limit_factor is None else max(1.0, limit_factor * P)
    try:
        s = make_schedule(kind, P, m, chunks, costs, limit, replicas)
    except ScheduleError as e:
        # Only the documented refusals: chunks the kind does not take, m not a
        # multiple of P for interleaving, or a limit below the kind's own peak.
        assert any(word in str(e) for word in ("chunks", "microbatches", "mem_limit"))
        return
    validate(s, limit)
    assert any(op.kind is Kind.OPT for _, _, op in s.ops())
    r = simulate(s, costs)
    assert r.makespan >= max(r.busy.values()) - 1e-9
    if limit is not None:
        assert peak(r) <= limit + 1e-9
    for w in s.workers:  # D identical replicas
        base = s.program(Worker(0, w.stage))
        assert [op._replace(replica=0) for op in s.program(w)] == list(base)
    assert from_text(to_text(s)) == s and from_json(to_json(s)) == s


def test_chunks_default_to_the_kind():
    assert make_schedule("zb-v", 4, 8).chunks == 2
    assert make_schedule("interleaved-1f1b", 4, 8).chunks == 2
    assert make_schedule("auto", 4, 8).chunks == 1


# --- impossible requests ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(kind="interleaved-1f1b", stages=4, microbatches=6), "microbatches"),
        (dict(kind="interleaved-1f1b", stages=4, microbatches=8, chunks=1), "chunks"),
        (dict(kind="zb-v", stages=4, microbatches=8, chunks=3), "chunks"),
        (dict(kind="zb-h1", stages=4, microbatches=8, chunks=2), "chunks"),
        (dict(kind="1f1b", stages=4, microbatches=8, mem_limit=3), "mem_limit"),
        (dict(kind="gpipe", stages=4, microbatches=8, mem_limit=7), "mem_limit"),
        (dict(kind="zb-h2", stages=4, microbatches=8, mem_limit=4), "mem_limit"),
        (dict(kind="zb-v", stages=4, microbatches=8, mem_limit=3), "mem_limit"),
        (dict(kind="auto", stages=4, microbatches=8, mem_limit=0.5), "mem_limit"),
        (dict(kind="auto", stages=4, microbatches=8, costs=Costs(1, -1, 1)), "costs"),
        (dict(kind="zb-h1", stages=2, microbatches=8, costs=Costs([1, 2, 3], 1, 1)), "stages"),
        (dict(kind="1f1b", stages=0, microbatches=8), "stages"),
        (dict(kind="zb-h1", stages=4, microbatches=0), "microbatches"),
        (dict(kind="auto", stages=4, microbatches=8, replicas=0), "replicas"),
        (dict(kind="auto", stages=4, microbatches=8, objective="speed"), "objective"),
        (dict(kind="pipedream", stages=4, microbatches=8), "kind"),
    ],
)
def test_impossible_requests(kwargs, word):
    with pytest.raises(ScheduleError, match=word):
        make_schedule(**kwargs)
