"""Steady iteration period with slow workers: mitigated vs. unmitigated vs. the bound.

For each deployment (D replicas, P=4 stages, m=8 microbatches per replica, unit
costs), kind (1f1b, zb-h1), slowdown factor and pattern (one slow worker, two
on different stages and replicas, one slow plus one failed), prints
- bound:       `slow_bound`, the least largest load of whole microbatch-slices;
- unmitigated: the schedule built as if nothing were slow (the fault-free one,
               or the one re-routed around the failure), priced at the speeds;
- mitigated:   `make_schedule(..., slow=...)`, part of the slow workers'
               slices moved to peers, priced at the speeds;
and the ratios mitigated/bound and mitigated/unmitigated, with each worker's
memory limited to the kind's own peak (P); then the mitigated period with the
limit at 2P ("mit 2P") and its ratio to the bound: where the first falls
short of the bound, memory is what holds it back. The target (issue 40): at
D=4, one worker at factor 2, mitigated <= 1.05 x bound and <= 0.7 x
unmitigated.

Run: python -m benchmarks.bench_slow [--plot out/slow_mitigated.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from pjit_pipe.ir.costs import Costs
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator import simulate, slow_bound

ITERATIONS = 8
STAGES, MICROBATCHES = 4, 8
REPLICAS = (2, 4, 8)
FACTORS = (1.5, 2.0, 3.0, 4.0)
KINDS = ("1f1b", "zb-h1")


def patterns(factor: float) -> list[tuple[str, dict, set]]:
    """(name, slow workers, failed workers) of each pattern at one factor."""
    return [
        ("one slow", {(0, 1): factor}, set()),
        ("two slow", {(0, 1): factor, (1, 2): factor}, set()),
        ("slow+failed", {(0, 1): factor}, {(1, 2)}),
    ]


def period(schedule, costs: Costs) -> float:
    return simulate(schedule, costs, iterations=ITERATIONS).steady_period


def row(kind: str, replicas: int, slow: dict, failed: set, mem_limit: float | None):
    """(bound, unmitigated, mitigated, search seconds, mitigated schedule)."""
    priced = Costs(slow=slow)
    args = (kind, STAGES, MICROBATCHES, None, Costs(), mem_limit, replicas)
    unmitigated = make_schedule(*args, failed=failed)
    start = time.perf_counter()
    mitigated = make_schedule(*args, failed=failed, slow=slow)
    took = time.perf_counter() - start
    bound = slow_bound(STAGES, MICROBATCHES, replicas, slow, failed)
    return bound, period(unmitigated, priced), period(mitigated, priced), took, mitigated


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=Path("out/slow_mitigated.png"))
    args = parser.parse_args([] if argv is None else argv)  # run.py calls main() bare
    print(
        f"P={STAGES} m={MICROBATCHES}, unit costs F=B=W=1, C=0; memory limit the kind's own "
        f"peak (P), and 2P in the last two columns; steady period over {ITERATIONS} iterations"
    )
    header = (
        f"{'kind':<6} {'D':>2} {'factor':>6}  {'pattern':<12} {'bound':>6} {'unmitig':>8} "
        f"{'mitig':>6} {'mit/bound':>9} {'mit/unmit':>9} {'search s':>8} {'mit 2P':>6} "
        f"{'2P/bound':>8}"
    )
    print(header)
    print("-" * len(header))
    to_bound, to_unmitigated, roomy_to_bound = [], [], []
    for kind in KINDS:
        for replicas in REPLICAS:
            for factor in FACTORS:
                for name, slow, failed in patterns(factor):
                    bound, unmit, mit, took, _ = row(kind, replicas, slow, failed, None)
                    roomy = row(kind, replicas, slow, failed, 2 * STAGES)[2]
                    to_bound.append(mit / bound)
                    to_unmitigated.append(mit / unmit)
                    roomy_to_bound.append(roomy / bound)
                    print(
                        f"{kind:<6} {replicas:>2} {factor:>6g}  {name:<12} {bound:>6g} "
                        f"{unmit:>8g} {mit:>6g} {mit / bound:>9.3f} {mit / unmit:>9.3f} "
                        f"{took:>8.2f} {roomy:>6g} {roomy / bound:>8.3f}"
                    )
    print(
        f"mitigated/bound: median {statistics.median(to_bound):.3f}, worst "
        f"{max(to_bound):.3f}; mitigated/unmitigated: median "
        f"{statistics.median(to_unmitigated):.3f}, worst {max(to_unmitigated):.3f}; "
        f"at 2P mitigated/bound: median {statistics.median(roomy_to_bound):.3f}, worst "
        f"{max(roomy_to_bound):.3f}"
    )
    for kind in KINDS:
        bound, unmit, mit, _, _ = row(kind, 4, {(0, 1): 2.0}, set(), None)
        verdict = "met" if mit <= 1.05 * bound and mit <= 0.7 * unmit else "NOT met"
        print(
            f"target ({kind}, D=4, worker 0:1 at factor 2): mitigated {mit:g} <= 1.05 x bound "
            f"{bound:g} = {1.05 * bound:g} and <= 0.7 x unmitigated {unmit:g} = "
            f"{0.7 * unmit:g}: {verdict}"
        )
    from pjit_pipe.simulator.charts import gantt

    slow = {(0, 1): 2.0}
    *_, picture = row("1f1b", 4, slow, set(), None)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    result = simulate(picture, Costs(slow=slow), iterations=2)
    title = "mitigated 1f1b, D=4 P=4 m=8, worker 0:1 at factor 2"
    path = gantt(result, args.plot, Costs(slow=slow), title=title)
    print(f"Gantt chart of two iterations, {title}: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
