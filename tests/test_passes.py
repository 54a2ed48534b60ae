"""Properties of the IR passes: each keeps a valid schedule valid, and does what it promises."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjit_pipe.ir import Costs, Kind, Op, Payload, Schedule, Worker, interleaved_layout, v_layout
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import (
    defer_w,
    fuse_stage,
    fuse_where_free,
    insert_comm,
    split_backward,
    stagger,
)
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator import simulate

EPS = 1e-9
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_schedule(rnd: random.Random, P: int, m: int, D: int, layout_kind: str) -> Schedule:
    """A valid schedule built by running ready ops in a random global order.

    Each (stage, microbatch) gets a fused BW or a split B+W at random. Because the
    programs come from one sequential execution that respects every dependency,
    the schedule cannot deadlock, whatever the order.
    """
    if layout_kind == "v":
        v, layout = 2, v_layout(P)
    else:
        v = 2 if layout_kind == "interleaved" else 1
        layout = interleaved_layout(P, v)
    S = P * v
    fused = {(s, j, r): rnd.random() < 0.5 for s in range(S) for j in range(m) for r in range(D)}
    done: set[Op] = set()
    todo: set[Op] = set()
    for (s, j, r), bw in fused.items():
        todo |= {Op(Kind.F, s, j, r)}
        todo |= {Op(Kind.BW, s, j, r)} if bw else {Op(Kind.B, s, j, r), Op(Kind.W, s, j, r)}
    todo |= {Op(Kind.OPT, s, -1, r) for s in range(S) for r in range(D)}

    def backward_done(s: int, j: int, r: int) -> bool:
        return Op(Kind.B, s, j, r) in done or Op(Kind.BW, s, j, r) in done

    def ready(op: Op) -> bool:
        s, j, r = op.stage, op.mb, op.replica
        if op.kind is Kind.F:
            return s == 0 or Op(Kind.F, s - 1, j, r) in done
        if op.kind in (Kind.B, Kind.BW):
            return Op(Kind.F, s, j, r) in done and (s == S - 1 or backward_done(s + 1, j, r))
        if op.kind is Kind.W:
            return Op(Kind.B, s, j, r) in done
        return all(  # OPT: every gradient of the stage, on every replica
            Op(Kind.W, s, jj, rr) in done or Op(Kind.BW, s, jj, rr) in done
            for jj in range(m)
            for rr in range(D)
        )

    programs: dict[Worker, list[Op]] = {Worker(r, p): [] for r in range(D) for p in range(P)}
    while todo:
        op = rnd.choice(sorted(o for o in todo if ready(o)))
        todo.remove(op)
        done.add(op)
        programs[Worker(op.replica, layout[op.stage])].append(op)
    return Schedule(P, v, m, D, layout, programs, kind="random")


@st.composite
def schedules(draw) -> Schedule:
    rnd = draw(st.randoms(use_true_random=False))
    P = draw(st.integers(1, 4))
    m = draw(st.integers(1, 5))
    D = draw(st.integers(1, 2))
    layout_kind = draw(st.sampled_from(["plain", "interleaved", "v"]))
    return validate(random_schedule(rnd, P, m, D, layout_kind))


@st.composite
def costs(draw) -> Costs:
    pick = st.sampled_from([0.5, 1.0, 2.0, 3.0])
    return Costs(
        draw(pick),
        draw(pick),
        draw(pick),
        draw(st.sampled_from([0.0, 0.5, 1.0])),
        draw(st.sampled_from([0.0, 1.0])),
    )


def non_w(schedule: Schedule, w: Worker) -> list[Op]:
    return [op for op in schedule.program(w) if op.kind is not Kind.W]


# --- split_backward -------------------------------------------------------------------


@FAST
@given(schedules())
def test_split_backward_keeps_validity_and_puts_w_right_after_b(s: Schedule) -> None:
    out = validate(split_backward(s))
    for w in s.alive_workers:
        expected = []
        for op in s.program(w):
            fused = op.kind is Kind.BW
            expected += [op._replace(kind=Kind.B), op._replace(kind=Kind.W)] if fused else [op]
        assert list(out.program(w)) == expected
    assert not any(op.kind is Kind.BW for _, _, op in out.ops())


# --- fuse_backward --------------------------------------------------------------------


@FAST
@given(schedules(), st.integers(0, 7))
def test_fuse_stage_keeps_validity_and_memory_and_touches_one_stage(s: Schedule, k: int) -> None:
    stage = k % s.num_virtual_stages
    out = validate(fuse_stage(s, stage))
    for w in s.alive_workers:
        others = [op for op in s.program(w) if op.stage != stage]
        assert [op for op in out.program(w) if op.stage != stage] == others
        mine = [op for op in out.program(w) if op.stage == stage]
        assert not any(op.kind in (Kind.B, Kind.W) for op in mine)
        # each B became a BW in place: the stage's ops keep their order
        kept = [op for op in s.program(w) if op.stage == stage and op.kind is not Kind.W]
        assert mine == [op._replace(kind=Kind.BW) if op.kind is Kind.B else op for op in kept]
    before, after = peak_memory(s), peak_memory(out)
    assert all(after[w] <= before[w] + EPS for w in before)


@FAST
@given(schedules(), costs())
def test_fuse_where_free_without_fused_prices_returns_the_schedule(s: Schedule, c: Costs) -> None:
    assert fuse_where_free(s, c) is s
    # fused prices equal to the split's: fusing never shortens the period either
    P = s.stages
    same = Costs(c.f, c.b, c.w, c.c, c.opt, f_fused=[c.f] * P, bw=[c.b + c.w] * P)
    assert fuse_where_free(s, same).programs == s.programs


def test_fuse_where_free_runs_a_stage_that_never_waits_fused() -> None:
    """1x2, all the work on the last stage (its split costs 10% more than BW and
    its split F 5% more): zb-h1's Ws there fill no bubble, so the stage runs
    fused and the period becomes 1f1b's. On balanced stages no period gets longer."""
    heavy = Costs(
        f=[0.1, 1.05], b=[0.01, 1.1], w=[0.1, 1.1], c=0.01, f_fused=[0.1, 1.0], bw=[0.11, 2.0]
    )
    zb = make_schedule("zb-h1", 2, 16)  # without costs: every stage split
    out = validate(fuse_where_free(zb, heavy))
    assert out.kind == "zb-h1+fused"
    assert not any(op.kind in (Kind.B, Kind.W) and op.stage == 1 for _, _, op in out.ops())
    one_f_one_b = make_schedule("1f1b", 2, 16)
    period = simulate(out, heavy, iterations=4).steady_period
    assert period == pytest.approx(simulate(one_f_one_b, heavy, iterations=4).steady_period)
    assert period < simulate(zb, heavy, iterations=4).steady_period - 1.0
    balanced = Costs(f=1.03, b=1.0, w=1.0, f_fused=1.0, bw=1.97)
    for kind in ("zb-h1", "zb-h2"):
        base = make_schedule(kind, 4, 8)
        fused = validate(fuse_where_free(base, balanced))
        assert (
            simulate(fused, balanced, iterations=4).steady_period
            <= simulate(base, balanced, iterations=4).steady_period + EPS
        )


# --- defer_w --------------------------------------------------------------------------


@FAST
@given(schedules(), costs(), st.booleans())
def test_defer_w_keeps_validity_memory_and_makespan(s: Schedule, c: Costs, limited: bool) -> None:
    s = split_backward(s)
    limit = max(peak_memory(s).values()) if limited else None
    out = validate(defer_w(s, c, mem_limit=limit), mem_limit=limit)
    assert simulate(out, c).makespan <= simulate(s, c).makespan + EPS
    for w in s.alive_workers:  # only W moves: every other op keeps its order
        assert non_w(out, w) == non_w(s, w)


def test_defer_w_reaches_the_lower_bound_on_1f1b() -> None:
    """Unit costs, P=4, m=8: fused 1F1B takes (m + P - 1)(F + B + W) = 33.

    With v=1 the last stage cannot start before (P-1)F and then has m(F+B+W) of
    work, so no schedule beats (P-1)F + m(F+B+W) = 27; deferring W reaches it, and
    still does within 1F1B's own memory (P on the first stage).
    """
    P, m, c = 4, 8, Costs()
    fused = make_schedule("1f1b", P, m)
    assert simulate(fused, c).makespan == (m + P - 1) * 3
    s = split_backward(fused)
    bound = (P - 1) * 1 + m * 3
    for limit in (None, P):
        out = validate(defer_w(s, c, mem_limit=limit), mem_limit=limit)
        assert simulate(out, c).makespan == bound
        assert bound < simulate(s, c).makespan <= (m + P - 1) * 3
        if limit is not None:
            assert max(peak_memory(out).values()) <= limit


@pytest.mark.parametrize(
    ("P", "m", "costs", "published"),
    [(4, 12, Costs(5, 6, 4, 1), 213), (8, 32, Costs(5, 6, 4, 1), 557)],
)
def test_defer_w_on_1f1b_matches_the_published_zb_h1_figures(
    P: int, m: int, costs: Costs, published: float
) -> None:
    """docs/design.md section 6: the zero-bubble heuristic under memory limit P."""
    s = split_backward(make_schedule("1f1b", P, m))
    out = validate(defer_w(s, costs, mem_limit=P), mem_limit=P)
    assert simulate(out, costs).makespan <= published


def test_defer_w_without_w_ops_changes_nothing() -> None:
    s = make_schedule("1f1b", 3, 4)
    assert defer_w(s).programs == s.programs


def test_defer_w_rejects_a_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="mem_limit"):
        defer_w(split_backward(make_schedule("1f1b", 2, 2)), mem_limit=0)


# --- insert_comm ----------------------------------------------------------------------


def cross_edges(s: Schedule) -> set[tuple]:
    """(payload, stage, mb, replica, src, dst) of every tensor whose consumer runs elsewhere."""
    where = {(op.kind, op.stage, op.mb, op.replica): w for w, _, op in s.ops()}

    def backward(st_: int, j: int, r: int) -> Worker | None:
        return where.get((Kind.B, st_, j, r)) or where.get((Kind.BW, st_, j, r))

    edges = set()
    for (kind, st_, j, r), src in where.items():
        if kind is Kind.F and st_ + 1 < s.num_virtual_stages:
            dst, payload = where[(Kind.F, st_ + 1, j, r)], Payload.ACT
        elif kind in (Kind.B, Kind.BW) and st_ > 0:
            dst, payload = backward(st_ - 1, j, r), Payload.GRAD
        else:
            continue
        if dst != src:
            edges.add((payload, st_, j, r, src, dst))
    return edges


@FAST
@given(schedules(), costs())
def test_insert_comm_is_valid_complete_and_free(s: Schedule, c: Costs) -> None:
    out = validate(insert_comm(s))
    sends = {
        (op.payload, op.stage, op.mb, op.replica, w, op.peer)
        for w, _, op in out.ops()
        if op.kind is Kind.SEND
    }
    recvs = {
        (op.payload, op.stage, op.mb, op.replica, op.peer, w)
        for w, _, op in out.ops()
        if op.kind is Kind.RECV
    }
    assert sends == recvs == cross_edges(s)
    assert simulate(out, c).makespan == pytest.approx(simulate(s, c).makespan)
    assert insert_comm(out).programs == out.programs  # idempotent


def test_insert_comm_skips_the_turn_of_a_v() -> None:
    P, m = 3, 2
    base = random_schedule(random.Random(0), P, m, 1, "v")
    out = insert_comm(base)
    turn = P - 1  # stages P-1 and P both live on the last position
    assert not any(
        op.kind in (Kind.SEND, Kind.RECV)
        and op.stage in (turn, turn + 1)
        and (op.payload is Payload.ACT) == (op.stage == turn)
        for _, _, op in out.ops()
    )
    assert len([op for _, _, op in out.ops() if op.kind is Kind.SEND]) == 2 * m * (2 * P - 2)


# --- stagger --------------------------------------------------------------------------


@FAST
@given(schedules())
def test_stagger_keeps_validity_and_places_opt_after_its_gradients(s: Schedule) -> None:
    out = validate(stagger(s))
    assert out.staggered
    if s.replicas > 1:  # replicas may block each other's moves (see the fallback test)
        return
    for w in out.alive_workers:
        prog = out.program(w)
        for i, op in enumerate(prog):
            if op.kind is Kind.OPT:
                last = max(
                    k
                    for k, o in enumerate(prog)
                    if o.kind in (Kind.W, Kind.BW) and o.stage == op.stage
                )
                assert all(o.kind is Kind.SEND for o in prog[last + 1 : i])


@FAST
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 2), costs())
def test_stagger_never_slows_the_steady_state(P: int, m: int, D: int, c: Costs) -> None:
    for s in (make_schedule("1f1b", P, m, replicas=D), make_schedule("gpipe", P, m, replicas=D)):
        s = defer_w(split_backward(s), c)
        plain = simulate(s, c, iterations=4).steady_period
        staggered = simulate(validate(stagger(s)), c, iterations=4).steady_period
        assert staggered <= plain + EPS


def test_stagger_brings_the_period_down_to_the_span() -> None:
    """When the last stage finishes last (heavy W there), the barrier makes every
    iteration cost the makespan; staggered, the pipeline overlaps iterations and the
    period drops to the span."""
    P, m = 4, 8
    c = Costs(f=1.0, b=1.0, w=[1.0, 1.0, 1.0, 2.0], opt=0.5)
    s = defer_w(split_backward(make_schedule("1f1b", P, m)), c)
    plain = simulate(s, c, iterations=6)
    staggered = simulate(validate(stagger(s)), c, iterations=6)
    assert plain.span < plain.makespan
    assert plain.steady_period == pytest.approx(plain.makespan)
    assert staggered.steady_period < plain.steady_period
    assert staggered.steady_period == pytest.approx(staggered.span)


def test_stagger_falls_back_when_replicas_would_wait_on_each_other() -> None:
    """Two replicas finish their two chunks in opposite orders: moving both OPTs
    would make each replica wait for the other's later gradient."""
    F0, F1 = (Op(Kind.F, s, 0, 0) for s in (0, 1))
    r0 = [
        F0,
        F1,
        Op(Kind.B, 1, 0, 0),
        Op(Kind.W, 1, 0, 0),
        Op(Kind.B, 0, 0, 0),
        Op(Kind.W, 0, 0, 0),
    ]
    r1 = [op._replace(replica=1) for op in r0]
    r1[3], r1[5] = r1[5], r1[3]  # W0 before W1 on replica 1
    r1[3], r1[4] = r1[4], r1[3]  # keep B0 before W0
    programs = {
        Worker(0, 0): [*r0, Op(Kind.OPT, 0, -1, 0), Op(Kind.OPT, 1, -1, 0)],
        Worker(1, 0): [*r1, Op(Kind.OPT, 0, -1, 1), Op(Kind.OPT, 1, -1, 1)],
    }
    s = validate(Schedule(1, 2, 1, 2, v_layout(1), programs))
    out = validate(stagger(s))
    moved = sum(
        out.program(w).index(opt) < len(out.program(w)) - 2
        for w in out.alive_workers
        for opt in out.program(w)
        if opt.kind is Kind.OPT
    )
    assert moved == 1
