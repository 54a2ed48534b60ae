"""Steady iteration period under failures: adaptive re-routing vs. the bound and two baselines.

For each deployment (D replicas, P stages, m microbatches per replica, unit
costs, memory limit 2P) and 0..3 failed workers, prints the steady period of
- adaptive: `schedule_with_failures` (re-routed to peers, B/W split, staggered),
- bound:    the work-conserving lower bound,
- drop:     the intact replicas run 1F1B on the whole global batch,
- naive:    re-routed 1F1B with fused BW and an iteration barrier,
and draws a Gantt chart of one re-routed schedule.

Run: python -m benchmarks.bench_failures [--plot out/failures_reroute.png]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.schedules.baselines import drop_replica, naive_reroute
from pjit_pipe.simulator.bounds import lower_bound
from pjit_pipe.simulator.simulate import simulate

ITERATIONS = 8
DEPLOYMENTS = [(2, 4, 8), (4, 4, 8), (4, 4, 16), (4, 8, 16), (8, 4, 8)]


def patterns(replicas: int, stages: int) -> list[tuple[str, FailurePattern]]:
    """0..3 failures on distinct stages and replicas, and 2..3 on one stage when it survives."""
    out = []
    for k in range(4):
        failed = {(i % replicas, (i * (stages // 2 + 1)) % stages) for i in range(k)}
        out.append(("spread", FailurePattern.of(replicas, stages, failed)))
    for k in (2, 3):
        if k < replicas:
            out.append(("stage", FailurePattern.of(replicas, stages, {(i, 1) for i in range(k)})))
    return out


def period(schedule, costs: Costs) -> float:
    return simulate(schedule, costs, iterations=ITERATIONS).steady_period


def row(replicas: int, stages: int, microbatches: int, pattern: FailurePattern, costs: Costs):
    limit = 2 * stages
    start = time.perf_counter()
    adaptive = schedule_with_failures(
        "1f1b", stages, microbatches, replicas, pattern, costs, mem_limit=limit
    )
    took = time.perf_counter() - start
    bound = lower_bound(stages, microbatches, replicas, pattern, costs)
    try:
        drop = period(drop_replica("1f1b", stages, microbatches, replicas, pattern, costs), costs)
    except ScheduleError:  # every replica lost a worker
        drop = float("nan")
    base = make_schedule("1f1b", stages, microbatches, replicas=replicas)
    naive = period(naive_reroute(base, pattern, costs), costs)
    got = period(adaptive, costs)
    return got, bound, drop, naive, took, adaptive


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=Path("out/failures_reroute.png"))
    args = parser.parse_args([] if argv is None else argv)  # run.py calls main() bare
    costs = Costs()
    header = (
        f"{'D':>2} {'P':>2} {'m':>3}  {'failed':<16} {'adaptive':>8} {'bound':>6} {'gap':>6} "
        f"{'drop':>6} {'naive':>6} {'search s':>8}"
    )
    print("unit costs F=B=W=1, C=0; memory limit 2P; steady period over", ITERATIONS, "iterations")
    print(header)
    print("-" * len(header))
    for replicas, stages, microbatches in DEPLOYMENTS:
        for _, pattern in patterns(replicas, stages):
            got, bound, drop, naive, took, _ = row(replicas, stages, microbatches, pattern, costs)
            print(
                f"{replicas:>2} {stages:>2} {microbatches:>3}  {pattern!s:<16} {got:>8g} "
                f"{bound:>6g} {got / bound - 1:>6.1%} {drop:>6g} {naive:>6g} {took:>8.2f}"
            )
    from pjit_pipe.simulator.charts import gantt

    pattern = FailurePattern.of(4, 4, {(0, 1)})
    *_, picture = row(4, 4, 8, pattern, costs)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    result = simulate(picture, costs, iterations=2)
    path = gantt(result, args.plot, title=f"re-routed 1f1b, D=4 P=4 m=8, failed {pattern}")
    print(f"Gantt chart of two iterations, D=4 P=4 m=8 failed {pattern}: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
