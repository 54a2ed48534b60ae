"""The exact engine: proven optima, checked against brute force, bounds and the heuristics.

Grid of proven optima: P in {2, 3, 4}, m in {4, 8}, costs F,B,W,C = 1,1,1,0 and
5,6,4,1, memory limits P and 2P (24 instances), plus one uneven-cost instance.
"""

from __future__ import annotations

import contextlib
import functools

import pytest

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import OPT, B, F, Op, W, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.schedules import make_schedule
from pjit_pipe.schedules.auto import auto
from pjit_pipe.schedules.exact import MAX_ORDER_BINARIES, refiner, solve_exact
from pjit_pipe.simulator.simulate import simulate

COSTS = {"unit": Costs(1, 1, 1, 0), "5,6,4,1": Costs(5, 6, 4, 1)}
UNEVEN = Costs(f=[2, 1, 1], b=[2, 2, 1], w=[1, 1, 2], c=0.5)
GRID = [
    (P, m, name, limit) for P in (2, 3, 4) for m in (4, 8) for name in COSTS for limit in (P, 2 * P)
]


@functools.cache
def solved(P: int, m: int, name: str, limit: float):
    return solve_exact(P, m, COSTS[name], mem_limit=limit, time_limit=60)


def makespan(schedule: Schedule, costs: Costs) -> float:
    return simulate(schedule, costs).makespan


def busiest_worker(P: int, m: int, costs: Costs) -> float:
    """Trivial bound: no worker can finish its own work faster than back to back."""
    return max(m * (f + b + w) for f, b, w in costs.per_stage(P)) + costs.opt


@pytest.mark.parametrize(("P", "m", "name", "limit"), GRID)
def test_proves_optimality_on_grid(P, m, name, limit):
    costs = COSTS[name]
    r = solved(P, m, name, limit)
    assert r.optimal
    assert r.gap <= 1e-6
    assert r.lower_bound == pytest.approx(r.makespan, rel=1e-6)
    validate(r.schedule, mem_limit=limit)
    assert max(peak_memory(r.schedule).values()) <= limit
    assert makespan(r.schedule, costs) == pytest.approx(r.makespan)
    assert busiest_worker(P, m, costs) <= r.makespan + 1e-9
    assert r.makespan <= makespan(make_schedule("1f1b", P, m), costs) + 1e-9  # 1F1B fits: peak P
    assert r.solve_seconds > 0


def test_uneven_stage_costs():
    r = solve_exact(3, 4, UNEVEN, mem_limit=3, time_limit=60)
    assert r.optimal
    validate(r.schedule, mem_limit=3)
    assert makespan(r.schedule, UNEVEN) == pytest.approx(r.makespan)
    assert (
        busiest_worker(3, 4, UNEVEN) <= r.makespan <= makespan(make_schedule("1f1b", 3, 4), UNEVEN)
    )


@pytest.mark.parametrize(("P", "m"), [(2, 4), (3, 4), (4, 4), (3, 8), (4, 8)])
def test_unit_costs_closed_form(P, m):
    """With unit costs and C=0 the last stage idles P-1 before its first F and then has 3m
    of work, so 3m+P-1 bounds every schedule; ZB-H2 (peak 2P) reaches it when m >= 2P-1."""
    r = solved(P, m, "unit", 2 * P)
    assert r.makespan >= 3 * m + P - 1
    zb_h2 = makespan(make_schedule("zb-h2", P, m), COSTS["unit"])
    assert r.makespan <= zb_h2
    if zb_h2 == 3 * m + P - 1:
        assert r.makespan == 3 * m + P - 1


def interleavings(chains: list[list[Op]]):
    """Every merge of `chains` that keeps each chain's own order."""
    if not any(chains):
        yield []
        return
    for i, chain in enumerate(chains):
        if chain:
            rest = [*chains[:i], chain[1:], *chains[i + 1 :]]
            for tail in interleavings(rest):
                yield [chain[0], *tail]


def within(order: list[Op], limit: float | None) -> bool:
    held, delta = 0.0, {"F": 1.0, "B": -0.5, "W": -0.5}
    for op in order:
        held += delta[op.kind.value]
        if limit is not None and held > limit + 1e-9:
            return False
    return True


def brute_force(P: int, m: int, costs: Costs, limit: float | None) -> float:
    """Best makespan over all per-worker orders (any microbatch order) that fit the limit."""
    per_worker = [
        [
            o
            for o in interleavings([[F(s, j), B(s, j), W(s, j)] for j in range(m)])
            if within(o, limit)
        ]
        for s in range(P)
    ]
    best = float("inf")

    def search(s: int, programs: dict) -> None:
        nonlocal best
        if s == P:
            schedule = Schedule(P, 1, m, 1, tuple(range(P)), programs)
            with contextlib.suppress(ScheduleError):  # deadlock: an order waits on itself
                best = min(best, makespan(schedule, costs))
            return
        for order in per_worker[s]:
            search(s + 1, {**programs, Worker(0, s): (*order, OPT(s))})

    search(0, {})
    return best


@pytest.mark.parametrize(
    ("P", "m", "costs", "limit"),
    [
        (2, 2, COSTS["unit"], None),
        (2, 2, COSTS["unit"], 1),
        (2, 2, COSTS["5,6,4,1"], 1.5),
        (2, 2, COSTS["5,6,4,1"], None),
        (2, 2, Costs(f=[1, 2], b=[2, 1], w=[1, 0.5], c=0.5), None),
        (3, 2, COSTS["5,6,4,1"], 1.5),
        (3, 2, COSTS["unit"], None),
    ],
)
def test_matches_brute_force(P, m, costs, limit):
    best = brute_force(P, m, costs, limit)
    r = solve_exact(P, m, costs, mem_limit=limit)
    assert r.optimal
    assert r.makespan == pytest.approx(best)
    one_f_one_b = make_schedule("1f1b", P, m)
    if limit is None or max(peak_memory(one_f_one_b).values()) <= limit:
        from_1f1b = solve_exact(P, m, costs, mem_limit=limit, warm_start=one_f_one_b)
        assert from_1f1b.optimal
        assert from_1f1b.makespan == pytest.approx(best)


def test_warm_start_from_1f1b_finds_the_optimum():
    """Starting from 1F1B the MILP itself must close the gap to the proven optimum."""
    costs = COSTS["5,6,4,1"]
    r = solve_exact(3, 4, costs, mem_limit=3, warm_start=make_schedule("1f1b", 3, 4))
    assert r.optimal
    assert r.makespan == pytest.approx(solved(3, 4, "5,6,4,1", 3).makespan)
    assert r.makespan < makespan(make_schedule("1f1b", 3, 4), costs)


def test_time_limit_returns_best_found_with_gap():
    costs = COSTS["5,6,4,1"]
    r = solve_exact(8, 16, costs, mem_limit=8, time_limit=1.0)
    validate(r.schedule, mem_limit=8)
    assert makespan(r.schedule, costs) == pytest.approx(r.makespan)
    assert busiest_worker(8, 16, costs) <= r.lower_bound <= r.makespan
    assert r.gap == pytest.approx((r.makespan - r.lower_bound) / r.makespan)
    assert r.optimal == (r.gap <= 1e-6)
    auto = make_schedule("auto", 8, 16, costs=costs, mem_limit=8)
    assert r.makespan <= makespan(auto, costs) + 1e-9


@pytest.mark.parametrize(("P", "m", "name", "limit"), GRID)
def test_auto_is_near_the_optimum(P, m, name, limit):
    costs = COSTS[name]
    auto = make_schedule("auto", stages=P, microbatches=m, costs=costs, mem_limit=limit)
    validate(auto, mem_limit=limit)
    ours = makespan(auto, costs)
    assert ours <= 1.03 * solved(P, m, name, limit).makespan + 1e-9
    assert ours <= makespan(make_schedule("zb-h1", P, m), costs) + 1e-9
    assert ours <= makespan(make_schedule("1f1b", P, m), costs) + 1e-9


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"time_limit": 0}, "time_limit"),
        ({"time_limit": -1.0}, "time_limit"),
        ({"stages": 0}, "stages"),
        ({"microbatches": -2}, "microbatches"),
        ({"stages": 8, "microbatches": 64}, "too large"),
        ({"mem_limit": 0.5}, "no schedule exists"),
        ({"mem_limit": "4"}, "mem_limit"),
        ({"warm_start": make_schedule("zb-v", 2, 4)}, "warm_start"),
        ({"warm_start": make_schedule("gpipe", 2, 4), "mem_limit": 2}, "warm_start"),
    ],
)
def test_bad_arguments(kwargs, needle):
    args = {"stages": 2, "microbatches": 4, **kwargs}
    with pytest.raises(ScheduleError, match=needle):
        solve_exact(**args)


def test_size_limit_is_the_binary_count():
    P, m = 8, 32
    assert 3 * P * m * (m - 1) // 2 <= MAX_ORDER_BINARIES
    with pytest.raises(ScheduleError, match="too large"):
        solve_exact(P, m + 1, time_limit=0.01)


def test_auto_with_exact_time_limit_reaches_the_optimum():
    """make_schedule('auto', exact_time_limit=...) hands auto's winner to the exact engine."""
    costs = Costs(f=[1, 3, 5, 4], b=[3, 1, 2, 2], w=[3, 5, 2, 3], c=1)
    plain = auto(4, 8, 1, costs, 2)
    refined = make_schedule("auto", 4, 8, costs=costs, mem_limit=2, exact_time_limit=30)
    validate(refined, mem_limit=2)
    best = solve_exact(4, 8, costs, mem_limit=2, time_limit=30)
    assert best.optimal
    assert makespan(refined, costs) == pytest.approx(best.makespan)
    assert makespan(refined, costs) <= makespan(plain, costs)


def test_refiner_keeps_two_chunk_winners():
    costs = COSTS["unit"]
    plain = auto(4, 8, 2, costs, 4)
    refined = auto(4, 8, 2, costs, 4, exact=refiner())
    assert refined.programs == plain.programs
