"""Slow workers (fail-slow): which workers of a D x P mesh run slower, and by how much.

A slow worker is alive and holds its stage's parameters, but each of its ops
takes `factor` (>= 1) times as long as on a healthy worker: a throttled GPU, a
degraded link, a noisy neighbour. The cost model prices it (`Costs.slow`); the
failure-aware search (`pjit_pipe.schedules.failure_aware`) moves part of its
microbatch-slices to the peers that hold the same stage, as re-routing moves a
failed worker's.

Factors are given as a mapping {(replica, stage): factor}, or on the command
line as ``R:S:FACTOR[,R:S:FACTOR...]`` (`parse_slow`), or with a step for
injected slowdowns as ``STEP:R:S:FACTOR[,...]`` (`parse_slow_events`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from pjit_pipe.errors import FailurePlanError
from pjit_pipe.ir.ops import Worker

SlowFactors = Mapping[tuple[int, int], float]  # (replica, stage) -> factor >= 1


def check_factor(factor: object, where: str, name: str = "slow") -> float:
    """`factor` as a float, or FailurePlanError unless it is a finite number >= 1.

    Args:
        factor: The slowdown of one worker.
        where: How the message names the worker (e.g. "worker 0:1").
        name: How the message names the option ("slow", "--slow").

    Returns:
        The factor as a float.

    Raises:
        FailurePlanError: `factor` is not a number, is below 1, or is not finite.
    """
    try:
        value = float(factor)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not 1.0 <= value < math.inf:
        raise FailurePlanError(
            f"{name}: the factor of {where} must be a finite number >= 1 (1 = full speed, "
            f"2 = half speed), got {factor!r}"
        )
    return value


def check_slow(
    slow: SlowFactors | None,
    replicas: int,
    stages: int,
    failed: Iterable[tuple[int, int]] = (),
    name: str = "slow",
) -> dict[Worker, float]:
    """The slow workers of a `replicas` x `stages` mesh, checked.

    Args:
        slow: {(replica, stage): factor}, or None for none.
        replicas: D, the mesh's replicas.
        stages: P, the mesh's stages.
        failed: Workers that are down: a failed worker has no speed.
        name: How messages name the option ("slow", "--slow").

    Returns:
        {Worker: factor} for every worker given, factors of 1 included.

    Raises:
        FailurePlanError: A worker outside the mesh, a failed one, or a factor
            that is not a finite number >= 1.
    """
    down = {Worker(*w) for w in failed}
    out: dict[Worker, float] = {}
    for key, factor in (slow or {}).items():
        try:
            worker = Worker(*(int(x) for x in key))
        except (TypeError, ValueError):
            raise FailurePlanError(
                f"{name}: keys must be (replica, stage) pairs, got {key!r}"
            ) from None
        if not (0 <= worker.replica < replicas and 0 <= worker.stage < stages):
            raise FailurePlanError(
                f"{name}: worker {worker.replica}:{worker.stage} is outside the "
                f"{replicas}x{stages} mesh (R < {replicas}, S < {stages})"
            )
        if worker in down:
            raise FailurePlanError(
                f"{name}: worker {worker.replica}:{worker.stage} is also failed; a failed "
                "worker runs nothing, so give it a factor or a failure, not both"
            )
        out[worker] = check_factor(factor, f"worker {worker.replica}:{worker.stage}", name)
    return out


def slowed(slow: Mapping[Worker, float]) -> dict[Worker, float]:
    """The workers of `slow` whose factor is above 1 (a factor of 1 is full speed).

    Args:
        slow: {Worker: factor}.

    Returns:
        The entries with factor > 1.
    """
    return {w: f for w, f in slow.items() if f > 1.0}


def _fields(token: str, count: int, form: str, name: str, text: str) -> list[str]:
    parts = token.split(":")
    if len(parts) != count:
        raise FailurePlanError(f"{name}: expected {form}[,{form}...], got {token!r} in {text!r}")
    return parts


def parse_slow(
    text: str, replicas: int, stages: int, failed: Iterable[tuple[int, int]] = ()
) -> dict[Worker, float]:
    """Parse the CLI form ``R:S:FACTOR[,R:S:FACTOR...]`` (empty: no slow worker).

    Args:
        text: The flag's value.
        replicas: D, the mesh's replicas.
        stages: P, the mesh's stages.
        failed: Workers given as failed (a worker cannot be both).

    Returns:
        {Worker: factor}, checked as `check_slow` does.

    Raises:
        FailurePlanError: A malformed token, a worker given twice, or what
            `check_slow` refuses; the message names --slow.
    """
    slow: dict[tuple[int, int], float] = {}
    for token in filter(None, (t.strip() for t in text.split(","))):
        r, s, factor = _fields(token, 3, "R:S:FACTOR", "--slow", text)
        try:
            key = (int(r), int(s))
        except ValueError:
            raise FailurePlanError(
                f"--slow: R and S must be integers, e.g. 0:1:2, got {token!r}"
            ) from None
        if key in slow:
            raise FailurePlanError(f"--slow: worker {r}:{s} is given twice; give it once")
        slow[key] = check_factor(factor, f"worker {r}:{s}", "--slow")
    return check_slow(slow, replicas, stages, failed, "--slow")


def parse_slow_events(text: str) -> dict[int, dict[Worker, float]]:
    """Parse the injection form ``STEP:R:S:FACTOR[,...]``: from step STEP on, worker
    R:S runs FACTOR times slower (FACTOR 1: it recovers).

    Args:
        text: The flag's value (empty: no event).

    Returns:
        {step: {Worker: factor}}; the mesh is checked by the caller.

    Raises:
        FailurePlanError: A malformed token, a negative step, a factor that is
            not a finite number >= 1, or one worker given twice at one step.
    """
    events: dict[int, dict[Worker, float]] = {}
    for token in filter(None, (t.strip() for t in text.split(","))):
        step, r, s, factor = _fields(token, 4, "STEP:R:S:FACTOR", "--slow", text)
        try:
            at, worker = int(step), Worker(int(r), int(s))
        except ValueError:
            raise FailurePlanError(
                f"--slow: STEP, R and S must be integers, e.g. 50:0:1:2, got {token!r}"
            ) from None
        if at < 0:
            raise FailurePlanError(f"--slow: the step must be >= 0, got {token!r}")
        if worker in events.setdefault(at, {}):
            raise FailurePlanError(f"--slow: worker {r}:{s} is given twice at step {at}")
        events[at][worker] = check_factor(factor, f"worker {r}:{s}", "--slow")
    return events
