"""How far the heuristics are from the optimum: the exact engine against auto, zb-h1 and 1F1B.

For each (P, m, costs, memory limit) the exact engine runs for at most
--time-limit seconds; the table shows its makespan, the proven lower bound,
whether optimality was proven, and the heuristics' makespans (event
simulation, one iteration). auto/opt is auto's makespan over the exact one.

Run: python -m benchmarks.bench_exact [--time-limit S]
"""

from __future__ import annotations

import argparse

from pjit_pipe.ir.costs import Costs
from pjit_pipe.schedules import make_schedule
from pjit_pipe.schedules.exact import solve_exact
from pjit_pipe.simulator.simulate import simulate

CASES = [
    (P, m, costs, limit_factor)
    for P, m in ((2, 8), (3, 8), (4, 8), (4, 12))
    for costs in ("1,1,1", "5,6,4,1")
    for limit_factor in (1, 2)
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S")
    args = parser.parse_args(argv)
    header = (
        f"{'P':>2} {'m':>3} {'costs':>8} {'limit':>5} | {'exact':>7} {'bound':>7} {'proven':>6} "
        f"{'secs':>6} | {'auto':>7} {'zb-h1':>7} {'1f1b':>7} {'auto/opt':>8}"
    )
    print(header)
    print("-" * len(header))
    for P, m, text, factor in CASES:
        costs, limit = Costs.parse(text), factor * P
        r = solve_exact(P, m, costs, mem_limit=limit, time_limit=args.time_limit)
        auto = make_schedule("auto", P, m, costs=costs, mem_limit=limit)
        spans = [
            simulate(s, costs).makespan
            for s in (auto, *(make_schedule(k, P, m) for k in ("zb-h1", "1f1b")))
        ]
        print(
            f"{P:>2} {m:>3} {text:>8} {limit:>5} | {r.makespan:>7g} {r.lower_bound:>7g} "
            f"{'yes' if r.optimal else 'no':>6} {r.solve_seconds:>6.2f} | "
            + " ".join(f"{x:>7g}" for x in spans)
            + f" {spans[0] / r.makespan:>8.3f}"
        )


if __name__ == "__main__":
    main()
