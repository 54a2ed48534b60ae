"""Peer re-routing and the failure-aware search, against the bound and the baselines."""

import json
import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern, permute_replicas
from pjit_pipe.ir.ops import Kind, Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.serialize import from_json
from pjit_pipe.passes.reroute import reroute
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.schedules.baselines import drop_replica, naive_reroute
from pjit_pipe.simulator.bounds import lower_bound
from pjit_pipe.simulator.simulate import simulate

UNIT = Costs()
D, P, M = 4, 4, 8
LIMIT = 2 * P


def period(schedule, costs=UNIT, iterations=8):
    return simulate(schedule, costs, iterations=iterations).steady_period


def busiest_load(failed, replicas=D, stages=P, microbatches=M):
    """Unit-cost load F+B+W=3 per microbatch of the busiest survivor, worked out by hand."""
    survivors = [replicas - sum(1 for _, s in failed if s == p) for p in range(stages)]
    return max(3 * math.ceil(replicas * microbatches / n) for n in survivors)


def peak(program, chunks=1):
    """Peak activation memory: F holds one chunk's activations (1/v), B and W free half each."""
    mem, top = 0.0, 0.0
    for op in program:
        mem += {Kind.F: 1.0, Kind.B: -0.5, Kind.W: -0.5, Kind.BW: -1.0}.get(op.kind, 0.0) / chunks
        top = max(top, mem)
    return top


@pytest.mark.parametrize("failed", [[(0, 0)], [(1, 1)], [(2, 2)], [(3, 3)]])
def test_one_failure_within_5_percent_of_bound_and_beats_baselines(failed):
    sched = schedule_with_failures("1f1b", P, M, D, failed, UNIT, mem_limit=LIMIT)
    bound = lower_bound(P, M, D, failed, UNIT)
    assert bound == busiest_load(failed) == 33
    got = period(sched)
    assert bound - 1e-9 <= got <= 1.05 * bound
    assert got < period(drop_replica("1f1b", P, M, D, failed, UNIT))
    assert got < period(naive_reroute(make_schedule("1f1b", P, M, replicas=D), failed, UNIT))
    assert max(peak(prog) for prog in sched.programs.values()) <= LIMIT


@pytest.mark.parametrize("failed", [[(0, 1), (1, 2)], [(0, 0), (0, 3)], [(3, 0), (1, 2)]])
def test_two_failures_in_different_stages_within_10_percent(failed):
    sched = schedule_with_failures("1f1b", P, M, D, failed, UNIT, mem_limit=LIMIT)
    bound = lower_bound(P, M, D, failed, UNIT)
    assert bound == busiest_load(failed)
    assert period(sched) <= 1.10 * bound


def test_lower_bound_includes_round_trip_for_few_microbatches():
    # One microbatch: stage 0 waits for the whole pipeline's F and B, then its own W.
    costs = Costs(2, 3, 1, c=0.5)
    assert lower_bound(4, 1, 2, (), costs) == 4 * (2 + 3) + 1 + 2 * 3 * 0.5
    sched = schedule_with_failures("1f1b", 4, 1, 2, [(0, 1)], costs, mem_limit=8)
    assert period(sched, costs) >= lower_bound(4, 1, 2, [(0, 1)], costs) - 1e-9


def test_unrecoverable_pattern_names_the_stage():
    failed = [(r, 2) for r in range(D)]
    with pytest.raises(ScheduleError, match="stage 2"):
        schedule_with_failures("1f1b", P, M, D, failed, UNIT, mem_limit=LIMIT)
    with pytest.raises(ScheduleError, match="stage 2"):
        reroute(make_schedule("1f1b", P, M, replicas=D), failed)


def test_permuted_patterns_share_one_schedule():
    a = [(0, 1), (2, 3)]
    b = [(3, 1), (1, 3)]  # a with replicas relabelled 0->3, 2->1
    sa = schedule_with_failures("1f1b", P, M, D, a, UNIT, mem_limit=LIMIT)
    sb = schedule_with_failures("1f1b", P, M, D, b, UNIT, mem_limit=LIMIT)
    pa = FailurePattern.of(D, P, a).canonical()[1]
    pb = FailurePattern.of(D, P, b).canonical()[1]
    assert permute_replicas(sa, pa) == permute_replicas(sb, pb)
    base = make_schedule("1f1b", P, M, replicas=D)
    ra, rb = reroute(base, a, mem_limit=LIMIT), reroute(base, b, mem_limit=LIMIT)
    assert permute_replicas(ra, pa) == permute_replicas(rb, pb)


def test_naive_baseline_keeps_fused_backward_and_barrier():
    base = make_schedule("1f1b", P, M, replicas=D)
    naive = naive_reroute(base, [(1, 2)], UNIT)
    kinds = {op.kind for prog in naive.programs.values() for op in prog}
    assert Kind.BW in kinds and not kinds & {Kind.B, Kind.W}
    assert not naive.staggered
    assert naive.program(Worker(1, 2)) == ()
    for w, prog in naive.programs.items():  # 1F1B's memory profile: P - p
        assert peak(prog) <= P - w.stage


def test_drop_replica_spreads_the_global_batch_over_intact_replicas():
    dropped = drop_replica("1f1b", P, M, D, [(0, 1), (2, 0)], UNIT)
    assert dropped.replicas == 2
    assert dropped.microbatches == math.ceil(D * M / 2)
    with pytest.raises(ScheduleError, match="every one of the 2 replicas"):
        drop_replica("1f1b", P, M, 2, [(0, 1), (1, 0)], UNIT)


@st.composite
def deployments(draw):
    kind = draw(st.sampled_from(["1f1b", "gpipe", "zb-h1", "zb-v"]))
    replicas = draw(st.integers(1, 3))
    stages = draw(st.integers(1, 4))
    microbatches = draw(st.integers(1, 5))
    mesh = [(r, s) for r in range(replicas) for s in range(stages)]
    failed = draw(st.sets(st.sampled_from(mesh), max_size=3))
    failed = {w for w in failed if any((r, w[1]) not in failed for r in range(replicas))}
    limit = draw(st.sampled_from([None, 1.0, 1.5, stages, 2 * stages]))
    return kind, replicas, stages, microbatches, failed, limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deployments())
def test_rerouted_schedule_runs_every_microbatch_once_within_memory(case):
    kind, replicas, stages, microbatches, failed, limit = case
    base = make_schedule(kind, stages, microbatches, replicas=replicas)
    sched = reroute(base, failed, UNIT, mem_limit=limit)  # validates
    assert sched.staggered
    assert sched.failed == {Worker(*w) for w in failed}
    where: dict[tuple, set] = {}
    counts: Counter = Counter()
    for w, prog in sched.programs.items():
        assert not prog or w not in sched.failed
        for op in prog:
            if op.kind in (Kind.F, Kind.B, Kind.W):
                counts[(op.kind, op.stage, op.mb, op.replica)] += 1
                where.setdefault((op.stage, op.mb, op.replica), set()).add(w)
    slots = [
        (s, j, r)
        for s in range(sched.num_virtual_stages)
        for j in range(microbatches)
        for r in range(replicas)
    ]
    for s, j, r in slots:
        for kind_ in (Kind.F, Kind.B, Kind.W):
            assert counts[(kind_, s, j, r)] == 1
        (worker,) = where[(s, j, r)]
        assert worker.stage == base.layout[s] and worker not in sched.failed
    assert sum(counts.values()) == 3 * len(slots)
    v = base.chunks
    budget = limit if limit is not None else max(peak(p, v) for p in base.programs.values())
    assert max(peak(prog, v) for prog in sched.programs.values()) <= budget
    for p in range(stages):  # balanced: no survivor gets more than its share, rounded up
        loads = Counter(w for ws in where.values() for w in ws if w.stage == p)
        alive = replicas - sum(1 for _, fs in failed if fs == p)
        assert max(loads.values()) == v * math.ceil(replicas * microbatches / alive)


def _cli_json(capsys, *argv):
    from pjit_pipe.cli import main

    assert main(["schedule", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_one_replica_no_failures_is_unchanged(capsys):
    plain = _cli_json(capsys, "1f1b", "-P", "3", "-m", "4")
    flagged = _cli_json(capsys, "1f1b", "-P", "3", "-m", "4", "--replicas", "1", "--failed", "")
    assert plain == flagged


def test_cli_failed_workers_are_rerouted(capsys):
    out = _cli_json(
        capsys,
        "1f1b",
        "-P",
        "4",
        "-m",
        "8",
        "--replicas",
        "4",
        "--failed",
        "0:1",
        "--mem-limit",
        "8",
        "--iterations",
        "6",
    )
    assert out["valid"]
    assert out["steady_period"] <= 1.05 * busiest_load([(0, 1)])
    assert len(out["peak_memory"]) == D * P and max(out["peak_memory"]) <= 8
    sched = from_json(out["schedule"])
    assert sched.failed == {Worker(0, 1)} and sched.staggered


def test_cli_unrecoverable_pattern_is_one_line_error(capsys):
    from pjit_pipe.cli import main

    assert main(["schedule", "1f1b", "-P", "2", "-m", "2", "-D", "2", "--failed", "0:1,1:1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stage 1" in err
