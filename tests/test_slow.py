"""Slow workers (fail-slow): mitigated schedules, the bound and the CLI."""

import itertools
import json
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjit_pipe.cli import main
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.ops import Kind, Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.serialize import from_json
from pjit_pipe.ir.slow import parse_slow, parse_slow_events
from pjit_pipe.passes import KEEPS, balanced_counts, share_placement
from pjit_pipe.passes.list_scheduler import priorities
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator import fill_bound, least_largest_load, simulate, slow_bound

ITERATIONS = 8


def period(schedule, costs: Costs) -> float:
    return simulate(schedule, costs, iterations=ITERATIONS).steady_period


def peak(program, chunks=1):
    """Peak activation memory: F holds one chunk's activations (1/v), B and W free half each."""
    mem, top = 0.0, 0.0
    for op in program:
        mem += {Kind.F: 1.0, Kind.B: -0.5, Kind.W: -0.5, Kind.BW: -1.0}.get(op.kind, 0.0) / chunks
        top = max(top, mem)
    return top


def brute_force_bound(items: int, unit: list[float]) -> float:
    """Every way to deal `items` identical items to len(unit) workers: the least largest load."""
    best = math.inf
    for split in itertools.product(range(items + 1), repeat=len(unit)):
        if sum(split) == items:
            best = min(best, max(n * u for n, u in zip(split, unit, strict=True)))
    return best


def test_bound_at_the_target_deployment_worked_by_hand():
    # D=4, m=8: 32 slices of F+B+W = 3 on stage 1, worker 0:1 twice as slow. Within 27 the
    # slow worker fits 4 (24) and each peer 9: 31 < 32; within 30, 5 + 3 x 10 >= 32.
    assert slow_bound(4, 8, 4, {(0, 1): 2.0}) == 30
    assert slow_bound(4, 8, 4, {}) == 24  # fault-free: m (F+B+W)
    # Failed 1:2 leaves stage 2 three workers for 32 slices: 11 x 3 = 33.
    assert slow_bound(4, 8, 4, {(0, 1): 2.0}, failed={(1, 2)}) == 33
    # Per-stage costs: stage 1 holds F+B+W = 6; its slow worker at 1.5 takes 9 a slice.
    costs = Costs(f=[1, 2], b=[1, 2], w=[1, 2])
    assert slow_bound(2, 4, 2, {(0, 1): 1.5}, costs=costs) == brute_force_bound(8, [9, 6])


def brute_force_fill(stages, items_per_stage, factors, room, costs):
    """fill_bound by enumeration: every split of each stage's slices, each worker's
    n x (F+B+W) x factor plus the forwards-only wait before its first backward."""
    f, b, w = costs
    best_of_stages = 0.0
    for p in range(stages):
        trip = sum((f + b) * min(factors[t]) for t in range(p + 1, stages))
        best = math.inf
        for split in itertools.product(range(items_per_stage + 1), repeat=len(factors[p])):
            if sum(split) != items_per_stage:
                continue
            times = [
                n * (f + b + w) * x + max(0.0, x * f + trip - min(room, n) * f * x)
                for n, x in zip(split, factors[p], strict=True)
                if n
            ]
            best = min(best, max(times))
        best_of_stages = max(best_of_stages, best)
    return best_of_stages


def test_fill_bound_worked_by_hand_and_by_enumeration():
    # 1F1B's own peak (4) at P=4: stage 0 runs 4 forwards, then waits for its first
    # backward, 1 + 3 x (1 + 1) = 7 after its first forward started: 3 idle besides 24.
    assert fill_bound(4, 8, 1, 4) == 27 == period(make_schedule("zb-h1", 4, 8), Costs())
    assert fill_bound(4, 8, 1, 8) == 24  # room for every forward: no wait
    # D=4, worker 0:1 at 1.5: a fast stage-1 worker waits 1 + 2 x 2 - 4 = 1; 32 slices
    # need a peer with 9 (28) unless the slow one takes 7 (31.5). slow_bound is 27.
    assert fill_bound(4, 8, 4, 4, {(0, 1): 1.5}) == 28 > slow_bound(4, 8, 4, {(0, 1): 1.5})
    costs = (1.0, 2.0, 1.0)
    for stages, replicas, room, slow in [(3, 2, 2, {(0, 1): 2.0}), (2, 3, 1, {(1, 0): 1.5})]:
        factors = [[slow.get((r, p), 1.0) for r in range(replicas)] for p in range(stages)]
        got = fill_bound(stages, 2, replicas, room, slow, costs=Costs(*costs))
        assert got == pytest.approx(brute_force_fill(stages, 2 * replicas, factors, room, costs))


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 7),
    st.lists(st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0, 4.0]), min_size=1, max_size=3),
    st.sampled_from([1.0, 2.5, 3.0]),
)
def test_least_largest_load_matches_brute_force(items, factors, work):
    unit = [work * f for f in factors]
    bound, caps = least_largest_load(items, unit)
    assert bound == pytest.approx(brute_force_bound(items, unit))
    assert sum(caps) >= items
    assert all(n * u <= bound + 1e-9 for n, u in zip(caps, unit, strict=True))


def test_factors_of_one_give_the_fault_free_schedule():
    ones = {(r, s): 1.0 for r in range(2) for s in range(3)}
    for kind in ("1f1b", "zb-h1", "zb-v"):
        plain = make_schedule(kind, 3, 4, replicas=2)
        assert make_schedule(kind, 3, 4, replicas=2, slow=ones) == plain
    failed = make_schedule("1f1b", 3, 4, replicas=2, failed={(1, 0)}, mem_limit=6)
    ones.pop((1, 0))
    assert make_schedule("1f1b", 3, 4, replicas=2, failed={(1, 0)}, mem_limit=6, slow=ones) == (
        failed
    )


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_target_one_worker_at_half_speed(kind):
    slow = {(0, 1): 2.0}
    priced = Costs(slow=slow)
    mitigated = make_schedule(kind, 4, 8, replicas=4, slow=slow)
    unmitigated = period(make_schedule(kind, 4, 8, replicas=4), priced)
    got = period(mitigated, priced)
    assert 30 - 1e-9 <= got <= 1.05 * 30
    assert got <= 0.7 * unmitigated
    moved = [
        (w, op)
        for w, prog in mitigated.programs.items()
        for op in prog
        if op.kind is Kind.F and op.replica != w.replica
    ]
    assert moved and all(op.replica == 0 and w.stage == 1 for w, op in moved)


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("blocks", [False, True])
def test_share_placements_run_each_slice_once_at_the_given_counts(keep, blocks):
    replicas, stages, microbatches = 4, 3, 6
    base = make_schedule("1f1b", stages, microbatches, replicas=replicas)
    pattern = FailurePattern.of(replicas, stages, {(3, 2)})
    costs = Costs(slow={(0, 1): 3.0, (2, 1): 2.0, (1, 2): 1.5})
    counts = balanced_counts(base, pattern, costs)
    for start in range(replicas):
        placement = share_placement(base, pattern, counts, keep, blocks, start)
        slots = itertools.product(range(stages), range(microbatches), range(replicas))
        assert sorted(placement) == sorted(slots)  # every slice placed, once
        ran = Counter(placement.values())
        assert ran == Counter({w: n for w, n in counts.items() if n})
        assert all(w.stage == s and w not in pattern.failed for (s, _, _), w in placement.items())
        if keep != "homes":
            continue
        for giver in (Worker(0, 1), Worker(2, 1)):  # fewer slices than its own m
            homes = [r for (_, _, r), w in placement.items() if w == giver]
            assert len(homes) == counts[giver] < microbatches
            assert len(set(homes)) == min(counts[giver], replicas)  # spread over the homes


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_two_workers_at_half_speed_on_four_replicas_meet_the_targets(kind):
    # Keeping only their own microbatches, the two slow workers slow every round trip of
    # their replicas' first stages, and the period stays at 32; slices from every home
    # spread those round trips and reach 31.
    slow = {(0, 1): 2.0, (1, 2): 2.0}
    priced = Costs(slow=slow)
    got = period(make_schedule(kind, 4, 8, replicas=4, slow=slow), priced)
    bound = slow_bound(4, 8, 4, slow)
    assert bound - 1e-9 <= got <= 1.05 * bound
    assert got <= 0.7 * period(make_schedule(kind, 4, 8, replicas=4), priced)


def test_priority_jitter_shifts_the_given_slots_ranks_only():
    base = make_schedule("1f1b", 2, 4, replicas=2)
    placement = {(s, j, r): Worker(r, s) for s in range(2) for j in range(4) for r in range(2)}
    mine = [slot for slot, w in placement.items() if w == Worker(0, 0)]
    fkey, bkey = priorities(base, placement)
    fj, bj = priorities(base, placement, jitter={(0, 0, 0): (2.5, 0.0)})
    assert sorted(mine, key=fkey) == [(0, j, 0) for j in range(4)]  # 1F1B: microbatch order
    assert sorted(mine, key=fj) == [(0, 1, 0), (0, 2, 0), (0, 0, 0), (0, 3, 0)]  # rank 0 -> 2.5
    assert sorted(mine, key=bj) == sorted(mine, key=bkey)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_two_slow_workers_on_two_replicas_reach_the_fill_bound(kind):
    # The sweep's best order leaves stage 1's busiest worker idle once more an iteration
    # (41); perturbed priorities (the search's shake phase) reach fill_bound's 40.
    slow = {(0, 1): 4.0, (1, 2): 4.0}
    got = make_schedule(kind, 4, 8, replicas=2, slow=slow)
    assert period(got, Costs(slow=slow)) == fill_bound(4, 8, 2, 4, slow) == 40
    assert all(peak(prog) <= 4 for prog in got.programs.values())
    ran = Counter(
        (op.stage, op.mb, op.replica)
        for _, prog in got.programs.items()
        for op in prog
        if op.kind is Kind.F
    )
    assert ran == Counter(itertools.product(range(4), range(8), range(2)))


@st.composite
def deployments(draw):
    kind = draw(st.sampled_from(["1f1b", "gpipe", "zb-h1", "zb-v"]))
    replicas = draw(st.integers(1, 3))
    stages = draw(st.integers(1, 3))
    microbatches = draw(st.integers(1, 4))
    mesh = [(r, s) for r in range(replicas) for s in range(stages)]
    failed = draw(st.sets(st.sampled_from(mesh), max_size=2))
    failed = {w for w in failed if any((r, w[1]) not in failed for r in range(replicas))}
    live = [w for w in mesh if w not in failed]
    slow = draw(
        st.dictionaries(
            st.sampled_from(live), st.sampled_from([1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=2
        )
    )
    roomy = draw(st.booleans())  # memory: the kind's own peak, or twice it
    return kind, replicas, stages, microbatches, failed, slow, roomy


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deployments())
def test_mitigated_schedules_run_every_slice_once_within_memory_above_the_bound(case):
    kind, replicas, stages, microbatches, failed, slow, roomy = case
    base = make_schedule(kind, stages, microbatches, replicas=replicas)
    limit = 2 * max(peak(p, base.chunks) for p in base.programs.values()) if roomy else None
    sched = make_schedule(
        kind, stages, microbatches, None, Costs(), limit, replicas, failed=failed, slow=slow
    )
    counts: Counter = Counter()
    for w, prog in sched.programs.items():
        assert not prog or w not in sched.failed
        for op in prog:
            if op.kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
                counts[(op.kind, op.stage, op.mb, op.replica)] += 1
                assert w.stage == base.layout[op.stage] and w not in sched.failed
    for s, j, r in itertools.product(
        range(base.num_virtual_stages), range(microbatches), range(replicas)
    ):
        f, b, w, bw = (counts[(k, s, j, r)] for k in (Kind.F, Kind.B, Kind.W, Kind.BW))
        assert f == 1 and (b, w, bw) in ((1, 1, 0), (0, 0, 1))
    v = base.chunks
    budget = limit if limit is not None else max(peak(p, v) for p in base.programs.values())
    assert max(peak(prog, v) for prog in sched.programs.values()) <= budget + 1e-9
    priced = Costs(slow=slow)
    bound = slow_bound(stages, microbatches, replicas, slow, failed)
    assert period(sched, priced) >= bound - 1e-9
    if v == 1:  # the pipeline fill at the memory budget: no schedule beats it either
        filled = fill_bound(stages, microbatches, replicas, budget, slow, failed)
        assert period(sched, priced) >= filled - 1e-9
        assert (
            period(base, priced) >= fill_bound(stages, microbatches, replicas, budget, slow) - 1e-9
        )
    if not failed:  # moving nothing is a candidate: mitigating never loses
        assert period(sched, priced) <= period(base, priced) + 1e-9


def test_bad_slow_values_name_the_parameter():
    with pytest.raises(ScheduleError, match="slow: the factor of worker 0:1 must be"):
        make_schedule("1f1b", 2, 2, replicas=2, slow={(0, 1): 0.5})
    with pytest.raises(ScheduleError, match="slow: worker 2:0 is outside the 2x2 mesh"):
        make_schedule("1f1b", 2, 2, replicas=2, slow={(2, 0): 2})
    with pytest.raises(ScheduleError, match="slow: worker 1:1 is also failed"):
        make_schedule("1f1b", 2, 2, replicas=2, failed={(1, 1)}, slow={(1, 1): 2})
    assert parse_slow("0:1:2, 1:0:1.5", 2, 2) == {Worker(0, 1): 2.0, Worker(1, 0): 1.5}
    assert parse_slow_events("50:0:1:2,150:0:1:1") == {
        50: {Worker(0, 1): 2.0},
        150: {Worker(0, 1): 1.0},
    }


BAD_SLOW = {
    "two fields": "0:1",
    "below one": "0:1:0.5",
    "not a number": "0:1:fast",
    "infinite": "0:1:inf",
    "outside": "0:5:2",
    "twice": "0:1:2,0:1:3",
    "also failed": "1:1:2",
}


@pytest.mark.parametrize("value", BAD_SLOW.values(), ids=BAD_SLOW.keys())
def test_cli_bad_slow_fails_with_one_line_naming_the_flag(capsys, value):
    argv = ["schedule", "1f1b", "-P", "2", "-m", "2", "-D", "2", "--failed", "1:1"]
    assert main([*argv, "--slow", value, "--json"]) != 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--slow" in err


def test_cli_json_adds_the_bound_and_both_periods(capsys, tmp_path):
    argv = ["1f1b", "-P", "2", "-m", "4", "-D", "2", "--iterations", "6", "--mem-limit", "4"]
    plot = tmp_path / "slow.png"
    assert main(["schedule", *argv, "--slow", "0:1:2", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    priced = Costs(slow={(0, 1): 2.0})
    plain = make_schedule("1f1b", 2, 4, replicas=2, mem_limit=4)
    # 8 slices of 3 on stage 1: the slow worker (6 a slice) takes 3, its peer 5 -> 18 / 15.
    assert out["slow_bound"] == 18 == brute_force_bound(8, [6, 3])
    unmitigated = simulate(plain, priced, iterations=6).steady_period
    assert out["unmitigated_period"] == pytest.approx(unmitigated)
    sched = from_json(out["schedule"])
    assert out["steady_period"] == pytest.approx(
        simulate(sched, priced, iterations=6).steady_period
    )
    assert out["slow_bound"] <= out["steady_period"] < out["unmitigated_period"]
    assert any(op.replica != w.replica for w, prog in sched.programs.items() for op in prog)
    assert plot.stat().st_size > 0
    assert main(["schedule", *argv, "--json"]) == 0
    assert "slow_bound" not in json.loads(capsys.readouterr().out)


def test_emulated_slow_workers_sleep_their_factor_longer():
    """The host of an emulated run (runtime/emulation.py) plans each op of worker 0:1 at
    twice its healthy price, every other worker's at its price."""
    from pjit_pipe.runtime.emulation import SleepingHost
    from pjit_pipe.tick_packing import pack_ticks

    slow = {(0, 1): 2.0}
    priced = Costs(slow=slow)
    for schedule in (
        make_schedule("1f1b", 2, 4, replicas=2),
        make_schedule("1f1b", 2, 4, replicas=2, slow=slow),
    ):
        table = pack_ticks(schedule, priced, 2)
        host = SleepingHost.of(table, priced, 0.001)
        healthy = Costs().duration_fn(schedule)
        planned = 0
        for device, worker in enumerate(schedule.alive_workers):
            factor = 2.0 if worker == Worker(0, 1) else 1.0
            for tick in host.shares[device]:
                for p in tick.ops:
                    assert p.duration == factor * healthy(worker, p.op)
                    planned += 1
        compute = [op for prog in schedule.programs.values() for op in prog if op.kind != Kind.OPT]
        assert planned == 2 * len(compute)  # every compute op of both iterations


@pytest.mark.slow
def test_cli_emulate_runs_the_mitigated_and_the_fault_free_table():
    import subprocess
    import sys
    from pathlib import Path

    argv = ["-P", "2", "-m", "2", "-D", "2", "--costs", "1,1,1,0", "--slow", "0:1:2"]
    argv += ["--iterations", "2", "--unit-ms", "5", "--json"]
    priced = Costs(slow={(0, 1): 2.0})
    for extra, schedule in (
        ([], make_schedule("1f1b", 2, 2, replicas=2, slow={(0, 1): 2.0})),
        (["--unmitigated"], make_schedule("1f1b", 2, 2, replicas=2)),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "pjit_pipe", "emulate", "1f1b", *argv, *extra],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["kind"] == schedule.kind and out["unmitigated"] == bool(extra)
        assert out["event_period"] == simulate(schedule, priced, 2).steady_period
        assert out["measured_period"] > 0


def test_mitigated_pipeline_computes_the_fault_free_loss_and_gradients():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pjit_pipe as pp

    model = nn.Sequential([nn.Dense(6), nn.Dense(5), nn.Dense(4), nn.Dense(2)])
    x = np.asarray(jax.random.normal(jax.random.key(0), (16, 3)))
    y = np.asarray(jax.random.normal(jax.random.key(1), (16, 2)))
    params = model.init(jax.random.key(2), x)

    def mse(out, target):
        return jnp.mean((out - target) ** 2)

    pm = pp.pipeline(model, stages=2, microbatches=4, mesh=pp.make_mesh(2, 2))
    mitigated = pm.with_slow({(0, 1): 2.0})
    programs = mitigated.schedule.programs
    assert any(op.replica != w.replica for w, prog in programs.items() for op in prog)
    assert mitigated.cuts is pm.cuts
    loss, grads = mitigated.value_and_grad(mse)(params, x, y)
    want, want_grads = jax.value_and_grad(lambda p: mse(model.apply(p, x), y))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(pp.FailurePlanError, match="slow: worker 0:1 is also failed"):
        pm.with_failures([(0, 1)]).with_slow({(0, 1): 2.0})


def test_slow_detector_marks_a_worker_after_confirm_probes_in_a_row():
    from pjit_pipe.runtime import FACTORS, SlowDetector, quantize

    assert [quantize(r) for r in (0.9, 1.2, 1.3, 1.8, 2.4, 2.6, 3.6, 9.0)] == [
        1.0,
        1.0,
        1.5,
        2.0,
        2.0,
        3.0,
        4.0,
        4.0,
    ]
    assert set(map(quantize, FACTORS)) == set(FACTORS)
    slow_w, other = Worker(0, 1), Worker(1, 1)
    timings = iter(
        [
            {slow_w: 2.0, other: 1.0, Worker(0, 0): 1.0},  # 2x: seen once
            {slow_w: 1.9, other: 1.0, Worker(0, 0): 1.0},  # 2x twice: marked
            {slow_w: 1.0, other: 1.0, Worker(0, 0): 1.0},  # back once: still slow
            {slow_w: 1.1, other: 1.0, Worker(0, 0): 1.0},  # back twice: recovered
        ]
    )
    detector = SlowDetector(lambda: next(timings), every=5, confirm=2)
    seen = [detector.observe(step) for step in range(20)]
    assert seen[0] == seen[4] == {}  # probes at steps 0, 5, 10, 15
    assert seen[5] == seen[14] == {slow_w: 2.0}
    assert seen[15] == seen[19] == {}


@pytest.mark.slow
def test_trainer_switches_to_the_mitigated_program_and_back_with_the_same_losses():
    import numpy as np

    import pjit_pipe as pp
    from pjit_pipe.models import mse_loss
    from pjit_pipe.runtime import InjectedSlowdowns, ResilientTrainer
    from tests.test_slow_variants import mlp_and_optax_losses

    model, params, opt, data, want = mlp_and_optax_losses(seed=0)
    pm = pp.pipeline(
        model, stages=2, microbatches=4, mesh=pp.make_mesh(data=2, stage=2), optimizer=opt
    )
    plan = {2: {(0, 1): 2.0}, 4: {(0, 1): 1.0}}
    tr = ResilientTrainer(pm, mse_loss, speeds=InjectedSlowdowns(plan))
    state = tr.init(params, data[0], precompile=False)
    got, slow_during = [], []
    for batch in data:
        state, loss = tr.step(state, batch)
        got.append(float(loss))
        slow_during.append(tr.slow)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert slow_during == [{}, {}, {Worker(0, 1): 2.0}, {Worker(0, 1): 2.0}, {}, {}]
    switches = [(e.step, e.slow) for e in tr.events if e.kind == "switch"]
    assert switches == [(2, ((Worker(0, 1), 2.0),)), (4, ())]
    # Nothing compiled ahead (precompile=False): the step waits for the mitigated program.
    waits = [(e.step, e.slow) for e in tr.events if e.kind == "wait"]
    assert waits == [(2, ((Worker(0, 1), 2.0),))]
    assert "slow = 0:1 x2" in next(e for e in tr.events if e.kind == "switch").describe()


@pytest.mark.parametrize("value", ["1:0:1", "1:0:1:0.5", "x:0:1:2", "1:0:1:2,1:0:1:3"])
def test_cli_train_bad_slow_fails_with_one_line(capsys, value):
    assert main(["train", "--model", "mlp", "--mesh", "2x2", "--slow", value]) != 0
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--slow" in err


@pytest.mark.slow
def test_cli_train_logs_the_switch_to_the_mitigated_program_and_back(capsys):
    argv = ["train", "--model", "mlp", "--mesh", "2x2", "--microbatches", "4", "--steps", "4"]
    assert main([*argv, "--json"]) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--slow", "1:0:1:2,3:0:1:1", "--json"]) == 0
    slowed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["loss"] for r in slowed] == pytest.approx([r["loss"] for r in plain], rel=1e-5)
    events = [e for r in slowed for e in r["events"]]
    switches = [e for e in events if "switched" in e]
    assert len(switches) == 2 and "slow = 0:1 x2" in switches[0] and "slow" not in switches[1]
    # The plan's program compiles in the background: a step that reaches it first waits.
    assert all("slow = 0:1 x2 is not compiled yet" in e for e in events if e not in switches)
