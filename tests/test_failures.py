"""Failure patterns: validation, canonical form under replica permutations, enumeration."""

from itertools import combinations, permutations

import pytest

from pjit_pipe.ir.failures import FailurePattern, enumerate_patterns, inverse, permute_replicas
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.schedules import make_schedule


def test_stage_without_survivor_is_unrecoverable():
    with pytest.raises(ScheduleError, match="stage 2 is unrecoverable"):
        FailurePattern(3, 4, frozenset({Worker(0, 2), Worker(1, 2), Worker(2, 2)}))


def test_worker_outside_mesh_rejected():
    with pytest.raises(ScheduleError, match=r"4:0 is outside the 2x3 mesh"):
        FailurePattern(2, 3, frozenset({Worker(4, 0)}))


def test_parse_cli_form():
    pat = FailurePattern.parse("0:1, 2:3", replicas=3, stages=4)
    assert pat.failed == {Worker(0, 1), Worker(2, 3)}
    assert pat.survivors(1) == [1, 2]
    assert pat.alive_replicas == [1]
    assert FailurePattern.parse("", 2, 2).failed == frozenset()
    with pytest.raises(ScheduleError, match="--failed"):
        FailurePattern.parse("0-1", 2, 2)


def _relabel(pattern: FailurePattern, perm) -> FailurePattern:
    failed = frozenset(Worker(perm[w.replica], w.stage) for w in pattern.failed)
    return FailurePattern(pattern.replicas, pattern.stages, failed)


def _stage_sets(pattern: FailurePattern) -> list[tuple[int, ...]]:
    return sorted(
        tuple(sorted(w.stage for w in pattern.failed if w.replica == r))
        for r in range(pattern.replicas)
    )


@pytest.mark.parametrize(
    "failed",
    [set(), {(0, 1)}, {(2, 0), (2, 3)}, {(0, 1), (1, 1), (3, 0)}, {(1, 2), (3, 2), (3, 0)}],
)
def test_canonical_is_invariant_under_replica_permutations(failed):
    pat = FailurePattern.of(4, 4, failed)
    canon, perm = pat.canonical()
    assert _relabel(pat, perm) == canon
    for p in permutations(range(4)):
        assert _relabel(pat, p).canonical()[0] == canon


def test_canonical_distinguishes_inequivalent_patterns():
    # Same number of failures and same failed stages, but one replica lost two workers.
    a = FailurePattern.of(3, 3, {(0, 0), (0, 1)})
    b = FailurePattern.of(3, 3, {(0, 0), (1, 1)})
    assert a.canonical()[0] != b.canonical()[0]


def test_enumeration_counts_match_brute_force():
    D, P, k = 3, 3, 3
    mesh = [(r, s) for r in range(D) for s in range(P)]
    classes = set()
    for n in range(k + 1):
        for combo in combinations(mesh, n):
            if all(any((r, s) not in combo for r in range(D)) for s in range(P)):
                classes.add(tuple(_stage_sets(FailurePattern.of(D, P, combo))))
    found = enumerate_patterns(D, P, k)
    assert len(found) == len(classes)
    assert {tuple(_stage_sets(p)) for p in found} == classes
    assert [len(p.failed) for p in found] == sorted(len(p.failed) for p in found)
    assert all(p.canonical()[0] == p for p in found)


def test_permute_replicas_round_trips():
    sched = make_schedule("1f1b", 3, 4, replicas=3)
    perm = (2, 0, 1)
    moved = permute_replicas(sched, perm)
    assert moved.programs[Worker(2, 1)][0].replica == 2
    assert permute_replicas(moved, inverse(perm)) == sched
