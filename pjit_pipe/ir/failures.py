"""Failure patterns: which workers of a D x P deployment are down.

Replicas hold identical parameters, so two patterns that differ only by a
permutation of replicas need the same re-routed schedule up to relabelling.
`FailurePattern.canonical` picks one representative per such class; the
search and the lowering build (and cache) one schedule per canonical pattern.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import combinations

from pjit_pipe.errors import FailurePlanError
from pjit_pipe.ir.ops import Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError


@dataclass(frozen=True)
class FailurePattern:
    """A set of failed workers (replica, stage) in a `replicas` x `stages` mesh.

    Construction raises FailurePlanError (a ScheduleError) for a worker outside the mesh or a stage
    whose every replica failed (its parameters and work cannot be recovered).
    """

    replicas: int
    stages: int
    failed: frozenset[Worker] = frozenset()

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.stages < 1:
            raise ScheduleError(
                f"replicas and stages must be >= 1, got replicas={self.replicas} "
                f"stages={self.stages}"
            )
        failed = frozenset(Worker(*w) for w in self.failed)
        for w in sorted(failed):
            if not (0 <= w.replica < self.replicas and 0 <= w.stage < self.stages):
                raise FailurePlanError(
                    f"failed worker {w} is outside the {self.replicas}x{self.stages} mesh"
                )
        for stage in range(self.stages):
            if not self.survivors(stage, failed):
                raise FailurePlanError(
                    f"stage {stage} is unrecoverable: all {self.replicas} of its replicas failed; "
                    "keep at least one replica of every stage alive"
                )
        object.__setattr__(self, "failed", failed)

    @classmethod
    def of(
        cls, replicas: int, stages: int, failed: FailurePattern | Iterable[tuple[int, int]]
    ) -> FailurePattern:
        """Accept a FailurePattern (checked against the mesh) or any iterable of (r, s)."""
        if isinstance(failed, FailurePattern):
            if (failed.replicas, failed.stages) != (replicas, stages):
                raise FailurePlanError(
                    f"failure pattern is for a {failed.replicas}x{failed.stages} mesh, "
                    f"not {replicas}x{stages}"
                )
            return failed
        return cls(replicas, stages, frozenset(Worker(*w) for w in failed))

    @classmethod
    def parse(cls, text: str, replicas: int, stages: int) -> FailurePattern:
        """Parse the CLI form ``R:S[,R:S...]`` (an empty string means no failures)."""
        workers = []
        for token in filter(None, (t.strip() for t in text.split(","))):
            try:
                r, s = (int(x) for x in token.split(":"))
            except ValueError:
                raise ScheduleError(
                    f"--failed: expected R:S[,R:S...], got {token!r} in {text!r}"
                ) from None
            workers.append(Worker(r, s))
        return cls(replicas, stages, frozenset(workers))

    def survivors(self, stage: int, failed: frozenset[Worker] | None = None) -> list[int]:
        """Replicas whose worker of `stage` is alive."""
        failed = self.failed if failed is None else failed
        return [r for r in range(self.replicas) if Worker(r, stage) not in failed]

    @property
    def alive_replicas(self) -> list[int]:
        """Replicas with no failed worker at all."""
        down = {w.replica for w in self.failed}
        return [r for r in range(self.replicas) if r not in down]

    def _stages_of(self, replica: int) -> tuple[int, ...]:
        return tuple(sorted(w.stage for w in self.failed if w.replica == replica))

    def canonical(
        self, slow: Mapping[Worker, float] | None = None
    ) -> tuple[FailurePattern, tuple[int, ...]]:
        """(canonical pattern, perm): perm[r] is the canonical index of replica r.

        Replicas are ordered by their failed stages: most failures first, then
        lexicographically; then by their slow workers (`slow`, {Worker: factor}),
        most first, then by (stage, factor); ties kept in index order. Equal up
        to a replica permutation <=> equal canonical patterns (and, with `slow`,
        equal relabelled factors).
        """
        speeds = {Worker(*w): f for w, f in (slow or {}).items()}

        def slow_of(r: int) -> tuple[tuple[int, float], ...]:
            return tuple(sorted((w.stage, f) for w, f in speeds.items() if w.replica == r))

        order = sorted(
            range(self.replicas),
            key=lambda r: (
                -len(self._stages_of(r)),
                self._stages_of(r),
                -len(slow_of(r)),
                slow_of(r),
                r,
            ),
        )
        perm = [0] * self.replicas
        for new, old in enumerate(order):
            perm[old] = new
        failed = frozenset(Worker(perm[w.replica], w.stage) for w in self.failed)
        return FailurePattern(self.replicas, self.stages, failed), tuple(perm)

    def __str__(self) -> str:
        return ",".join(str(w) for w in sorted(self.failed)) or "-"


def enumerate_patterns(
    replicas: int, stages: int, max_failures: int, canonical: bool = True
) -> list[FailurePattern]:
    """Every recoverable pattern with 0..max_failures failed workers: one per
    class up to a replica permutation (its canonical form), or with
    canonical=False every one (each device set needs its own executable).

    Ordered by number of failures, then by failed workers.
    """
    if max_failures < 0:
        raise ScheduleError(f"max_failures must be >= 0, got {max_failures}")
    mesh = [Worker(r, s) for r in range(replicas) for s in range(stages)]
    seen: set[frozenset[Worker]] = set()
    out: list[FailurePattern] = []
    for k in range(min(max_failures, len(mesh)) + 1):
        found = []
        for combo in combinations(mesh, k):
            try:
                pattern = FailurePattern(replicas, stages, frozenset(combo))
            except ScheduleError:
                continue  # some stage lost every replica
            if canonical:
                pattern, _ = pattern.canonical()
                if pattern.failed in seen:
                    continue
                seen.add(pattern.failed)
            found.append(pattern)
        out += sorted(found, key=lambda p: sorted(p.failed))
    return out


def permute_replicas(schedule: Schedule, perm: tuple[int, ...]) -> Schedule:
    """Relabel replica r as perm[r] everywhere: workers, ops' home replicas, peers, failed set."""
    if sorted(perm) != list(range(schedule.replicas)):
        raise ScheduleError(
            f"perm {list(perm)} is not a permutation of {schedule.replicas} replicas"
        )

    def move(w: Worker) -> Worker:
        return Worker(perm[w.replica], w.stage)

    def relabel(op: Op) -> Op:
        peer = None if op.peer is None else move(op.peer)
        return op._replace(replica=perm[op.replica], peer=peer)

    programs = {move(w): [relabel(op) for op in prog] for w, prog in schedule.programs.items()}
    return schedule.replace(programs=programs, failed=frozenset(map(move, schedule.failed)))


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation that undoes `perm`."""
    out = [0] * len(perm)
    for old, new in enumerate(perm):
        out[new] = old
    return tuple(out)


def check_failure_plan(
    fail: Mapping[int, Iterable[tuple[int, int]]],
    rejoin: Mapping[int, Iterable[tuple[int, int]]],
    replicas: int,
    stages: int,
    steps: int | None = None,
    down: Iterable[tuple[int, int]] = (),
    start: int = 0,
    names: tuple[str, str] = ("fail", "rejoin"),
) -> None:
    """Refuse, before anything compiles, a plan of failures and rejoins that cannot
    run: a worker outside the replicas x stages mesh, an event at or after `steps`,
    a failure of a worker already down, a rejoin of a worker that is not down, or
    every replica of a stage down at once. Raises FailurePlanError naming the
    option (`names`: how the caller spells the fail and rejoin arguments).

    Plays the plan from step `start` with the workers `down` down, as
    `InjectedFailures` does: the rejoins of step k happen before it starts, its
    failures during it; events before `start` (a resumed run) already happened.
    """
    fail_name, rejoin_name = names
    plan = {fail_name: fail, rejoin_name: rejoin}
    for option, events in plan.items():
        for step, workers in sorted(events.items()):
            for r, s in workers:
                if not (0 <= r < replicas and 0 <= s < stages):
                    raise FailurePlanError(
                        f"{option}: worker {r}:{s} at step {step} is outside the mesh "
                        f"{replicas}x{stages} (R < {replicas}, S < {stages})"
                    )
            if steps is not None and step >= steps:
                raise FailurePlanError(
                    f"{option}: step {step} is past the last step ({steps} steps run steps "
                    f"0-{steps - 1}); use a step below {steps} or raise the step count"
                )
    now = {(int(r), int(s)) for r, s in down}
    for step in sorted(k for k in {*fail, *rejoin} if k >= start):
        for r, s in rejoin.get(step, []):
            if (r, s) not in now:
                raise FailurePlanError(
                    f"{rejoin_name}: worker {r}:{s} is not down before step {step} (it never "
                    f"failed, or already rejoined); rejoin only a worker that {fail_name} "
                    "took down earlier"
                )
            now.discard((r, s))
        for r, s in fail.get(step, []):
            if (r, s) in now:
                raise FailurePlanError(
                    f"{fail_name}: worker {r}:{s} is already down at step {step}; drop it, "
                    f"or {rejoin_name} it at an earlier step first"
                )
            now.add((r, s))
        for s in range(stages):
            if all((r, s) in now for r in range(replicas)):
                raise FailurePlanError(
                    f"{fail_name}: at step {step} every replica of stage {s} is down, so its "
                    f"parameters are lost; keep one of the {replicas} workers R:{s} alive"
                )
