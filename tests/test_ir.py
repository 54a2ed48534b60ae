"""The schedule IR: text/JSON forms, the validator's rejections, memory and timing semantics."""

import pytest

from pjit_pipe.ir import (
    BW,
    OPT,
    RECV,
    SEND,
    B,
    Costs,
    DeadlockError,
    F,
    Payload,
    Schedule,
    ScheduleError,
    W,
    Worker,
    from_json,
    from_text,
    memory_trace,
    to_json,
    to_text,
    validate,
)
from pjit_pipe.ir.lockstep import tick_table
from pjit_pipe.ir.memory import DESIGN_UNITS, StoredBytes, stored_peak, stored_trace
from pjit_pipe.schedules import make_schedule
from pjit_pipe.schedules.classic import gpipe, one_f_one_b
from pjit_pipe.simulator import simulate


def two_stage(p0, p1, **kw) -> Schedule:
    """A 2-stage, 1-microbatch-per-program schedule with the given programs."""
    return Schedule(
        stages=2,
        chunks=1,
        microbatches=kw.pop("m", 1),
        replicas=1,
        layout=(0, 1),
        programs={Worker(0, 0): p0, Worker(0, 1): p1},
        **kw,
    )


GOOD = (
    [F(0, 0), B(0, 0), W(0, 0), OPT(0)],
    [F(1, 0), B(1, 0), W(1, 0), OPT(1)],
)


def test_good_schedule_validates():
    validate(two_stage(*GOOD))


@pytest.mark.parametrize(
    ("p0", "p1", "message"),
    [
        # B up the stages: stage 0's B needs stage 1's B; here stage 1 waits for stage 0 forever.
        ([F(0, 0), B(0, 0), W(0, 0), OPT(0)], [B(1, 0), F(1, 0), W(1, 0), OPT(1)], "depends on"),
        # W before its B on the same worker.
        ([F(0, 0), W(0, 0), B(0, 0), OPT(0)], GOOD[1], "depends on"),
        # OPT before the stage's last W.
        ([F(0, 0), B(0, 0), OPT(0), W(0, 0)], GOOD[1], "depends on"),
        # An op run twice.
        ([F(0, 0), F(0, 0), B(0, 0), W(0, 0), OPT(0)], GOOD[1], "runs twice"),
        # An op never run.
        ([F(0, 0), B(0, 0), OPT(0)], GOOD[1], "W0.0r0 never runs"),
        # BW and its split halves both present.
        ([F(0, 0), BW(0, 0), B(0, 0), W(0, 0), OPT(0)], GOOD[1], "split"),
        # Missing OPT.
        ([F(0, 0), B(0, 0), W(0, 0)], GOOD[1], "OPT0 never runs"),
        # An op on a worker that does not hold its stage.
        ([F(0, 0), F(1, 0), B(0, 0), W(0, 0), OPT(0)], GOOD[1], "lives on 1, not position 0"),
        # Microbatch out of range.
        ([F(0, 0), F(0, 3), B(0, 0), W(0, 0), OPT(0)], GOOD[1], "out of range"),
    ],
)
def test_validator_rejects_naming_the_op(p0, p1, message):
    with pytest.raises(ScheduleError, match=message):
        validate(two_stage(p0, p1))


def test_cross_worker_cycle_is_a_deadlock():
    # Stage 0 runs B before its second F, stage 1 runs its first F only after F(1,1): a cycle.
    p0 = [F(0, 0), B(0, 0), F(0, 1), B(0, 1), W(0, 0), W(0, 1), OPT(0)]
    p1 = [F(1, 1), F(1, 0), B(1, 0), B(1, 1), W(1, 0), W(1, 1), OPT(1)]
    with pytest.raises(DeadlockError, match="deadlock"):
        validate(two_stage(p0, p1, m=2))


def test_memory_limit_names_worker_and_op():
    s = gpipe(2, 4)
    validate(s, mem_limit=4)
    with pytest.raises(
        ScheduleError, match=r"op #2 F0\.2 on worker 0:0: memory 3 exceeds the limit 2"
    ):
        validate(s, mem_limit=2)


def test_memory_trace_follows_f_b_w_rule():
    s = two_stage(*GOOD)
    assert memory_trace(s, Worker(0, 0)) == [1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize(("P", "m"), [(1, 1), (2, 3), (4, 8), (3, 2)])
def test_classic_memory_closed_forms(P, m):
    """GPipe holds all m microbatches; 1F1B holds min(P - p, m) on position p."""
    g, o = gpipe(P, m), one_f_one_b(P, m)
    for p in range(P):
        assert max(memory_trace(g, Worker(0, p))) == m
        assert max(memory_trace(o, Worker(0, p))) == min(P - p, m)


def test_stored_bytes_price_what_each_op_frees():
    """DESIGN_UNITS is memory_trace's pricing (times v); a split stage whose B stores
    more cotangents than it frees holds more after B than after F."""
    for kind, P, m in (("1f1b", 4, 8), ("zb-h1", 4, 8), ("zb-v", 4, 8), ("gpipe", 3, 4)):
        sched = make_schedule(kind, P, m)
        units = dict.fromkeys(range(sched.num_virtual_stages), DESIGN_UNITS)
        for w in sched.workers:
            scaled = [x / sched.chunks for x in stored_trace(sched, w, units)]
            assert scaled == pytest.approx(memory_trace(sched, w))
    split = {0: StoredBytes(until_b=0, until_w=5), 1: StoredBytes(until_b=2, until_w=1, from_b=3)}
    s = two_stage(*GOOD)
    assert stored_trace(s, Worker(0, 0), split) == [5, 5, 0, 0]
    assert stored_trace(s, Worker(0, 1), split) == [3, 4, 0, 0]
    assert stored_peak(s, split) == {Worker(0, 0): 5, Worker(0, 1): 4}
    fused = s.replace(programs={**s.programs, Worker(0, 1): [F(1, 0), BW(1, 0), OPT(1)]})
    assert stored_trace(fused, Worker(0, 1), {1: StoredBytes(0, 3)}) == [3, 0, 0]


@pytest.mark.parametrize(("P", "m", "f", "b", "w", "c"), [(4, 8, 1, 1, 1, 0), (3, 5, 2, 3, 1, 0.5)])
def test_gpipe_makespan_closed_form(P, m, f, b, w, c):
    """GPipe: (P-1)(F+C) to fill, m(F+B+W) on the last stage, (P-1)(B+W+C) to drain."""
    expected = (m + P - 1) * (f + b + w) + 2 * (P - 1) * c
    assert simulate(gpipe(P, m), Costs(f, b, w, c)).makespan == pytest.approx(expected)


@pytest.mark.parametrize(
    ("P", "m", "f", "b", "w"), [(4, 8, 1, 1, 1), (3, 5, 2, 3, 1), (5, 2, 1, 2, 2)]
)
def test_1f1b_makespan_closed_form(P, m, f, b, w):
    """Without communication cost 1F1B matches GPipe's (m + P - 1)(F + B + W)."""
    expected = (m + P - 1) * (f + b + w)
    assert simulate(one_f_one_b(P, m), Costs(f, b, w)).makespan == pytest.approx(expected)


def test_text_and_json_round_trip_with_replicas_and_rerouted_ops():
    s = one_f_one_b(3, 4, replicas=2)
    assert from_text(to_text(s)) == s
    assert from_json(to_json(s)) == s
    # A hand-made re-routed program: replica 1's microbatch runs on replica 0's worker.
    prog = [F(0, 0, 1), SEND(Payload.ACT, 0, 0, 1, Worker(1, 1)), B(0, 0, 1), W(0, 0, 1)]
    s2 = s.replace(programs={**s.programs, Worker(0, 0): prog}, failed=frozenset())
    text = to_text(s2)
    assert "F0.0r1" in text and "SEND:act:0.0r1->1:1" in text
    assert from_text(text) == s2
    assert from_json(to_json(s2)) == s2


@pytest.mark.parametrize("bad", ["X0.0", "F0", "SEND:act:0.0<-0:1", "OPT", "F0.0r"])
def test_bad_tokens_are_rejected(bad):
    text = to_text(two_stage(*GOOD)).replace("F0.0", bad, 1)
    with pytest.raises(ScheduleError):
        from_text(text)


def _with_comm(p0_extra, p1_extra) -> Schedule:
    p0 = [F(0, 0), *p0_extra, B(0, 0), W(0, 0), OPT(0)]
    p1 = [*p1_extra, F(1, 0), B(1, 0), W(1, 0), OPT(1)]
    return two_stage(p0, p1)


def test_explicit_comm_is_checked():
    w0, w1 = Worker(0, 0), Worker(0, 1)
    send = SEND(Payload.ACT, 0, 0, 0, w1)
    recv = RECV(Payload.ACT, 0, 0, 0, w0)
    gsend = SEND(Payload.GRAD, 1, 0, 0, w0)
    grecv = RECV(Payload.GRAD, 1, 0, 0, w1)
    ok = two_stage(
        [F(0, 0), send, grecv, B(0, 0), W(0, 0), OPT(0)],
        [recv, F(1, 0), B(1, 0), gsend, W(1, 0), OPT(1)],
    )
    validate(ok)
    # With C = 2: F0 (1) + C (2) + F1 + B1 (2) + C (2) + B0 + W0 (2) = 9.
    assert simulate(ok, Costs(1, 1, 1, 2)).makespan == 9
    # A RECV with no SEND.
    with pytest.raises(ScheduleError, match="0 SEND and 1 RECV"):
        validate(
            two_stage(
                [F(0, 0), grecv, B(0, 0), W(0, 0), OPT(0)],
                [recv, F(1, 0), B(1, 0), gsend, W(1, 0), OPT(1)],
            )
        )
    # Both workers receive before they send: a communication deadlock.
    with pytest.raises(DeadlockError):
        validate(
            two_stage(
                [F(0, 0), grecv, send, B(0, 0), W(0, 0), OPT(0)],
                [recv, F(1, 0), B(1, 0), gsend, W(1, 0), OPT(1)],
            )
        )


def test_lockstep_table_respects_dependencies_and_order():
    s = one_f_one_b(4, 8)
    ticks = tick_table(s)
    done_at = {}
    for t, tick in enumerate(ticks):
        for w, op in tick.items():
            done_at[(w, op)] = t
    for w in s.workers:
        order = [done_at[(w, op)] for op in s.program(w)]
        assert order == sorted(order) and len(set(order)) == len(order)
    for p in range(1, 4):
        for j in range(8):
            assert done_at[(Worker(0, p), F(p, j))] > done_at[(Worker(0, p - 1), F(p - 1, j))]
    # Lockstep can only be slower than asynchronous execution.
    assert simulate(s, mode="lockstep").makespan >= simulate(s).makespan


def test_barrier_vs_staggered_iterations():
    s = one_f_one_b(4, 8)
    unstaggered = simulate(s, iterations=3)
    assert unstaggered.steady_period == pytest.approx(unstaggered.makespan)
    staggered = simulate(s.replace(staggered=True), iterations=3)
    assert staggered.steady_period <= unstaggered.steady_period


def test_a_stage_the_schedule_does_not_split_is_priced_at_its_fused_costs():
    """1F1B runs F and a fused BW: with Costs.f_fused and Costs.bw its makespan is
    the closed form (m + P - 1)(F + BW) of those; zb-h1 splits every stage and
    keeps (f, b, w). Without them every price is as before (BW = b + w)."""
    P, m = 4, 8
    both = Costs(f=1.0, b=1.0, w=1.0, f_fused=0.5, bw=3.0)
    assert simulate(one_f_one_b(P, m), both).makespan == pytest.approx((m + P - 1) * 3.5)
    assert simulate(one_f_one_b(P, m), Costs(1, 1, 1)).makespan == pytest.approx((m + P - 1) * 3)
    zb = make_schedule("zb-h1", P, m)
    assert simulate(zb, both).makespan == simulate(zb, Costs(1, 1, 1)).makespan
    with pytest.raises(ScheduleError, match="f_fused: 2 per-stage costs given for 4 stages"):
        Costs(f_fused=[1, 2]).per_stage(4)
