"""Emulated slow workers, one process per device: measured period against its price.

The issue 40 case: 1F1B, D=4, P=4, m=8, unit costs, worker 0:1 at factor 2,
one process per device (`pjit-pipe emulate --processes`, neighbour-
synchronous ticks), U = 40 ms a cost unit.

A tick costs its machinery besides its ops' sleeps (callbacks,
conditionals, gloo ppermutes, the sleeps' late wake-ups), a fixed time a
tick that the prices count as `--tick-cost` (`Costs.tick`). It is measured
first, on a third table: the same deployment with no slow worker, run with
no tick cost; its excess over its price, spread over its ticks, is the
machinery's ms a tick, and T = that / U. Then each round runs the mitigated
table and the unmitigated (fault-free) one, in alternating order, packed
and priced with that tick cost, with the same command the CLI documents:

    pjit-pipe emulate 1f1b --stages 4 --microbatches 8 --costs 1,1,1,0 --replicas 4
        --slow 0:1:2 --unit-ms 40 --tick-cost T --processes --json [--unmitigated]

and prints each table's measured period, its price (`neighbor_period`, the
price of the multi-controller runtime, T a tick included) and the ratios:
measured / price and mitigated / unmitigated measured. The targets:
mitigated within 1.10 x its price, and at most 0.75 x the unmitigated
measured period. `--tick-ms 0` prices the ops alone.

What is left over the price: the last column spreads it over the table's
ticks, (measured - price) x U / (ticks an iteration), in ms a tick. A fixed
cost a tick gives the same ms a tick for every table and at every U, so the
excess in units shrinks as 1/U: give several units (`--unit-ms 40,80`) to
check. (Sleeps of U/1000 would time the machinery alone, but 16
processes that never sleep then contend for the host's cores, which the
sleeping runs do not.)

Run: python -m benchmarks.bench_slow_emulate [--rounds 3] [--unit-ms 40[,80...]]
     [--tick-ms auto|MS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = [
    "emulate",
    "1f1b",
    "--stages",
    "4",
    "--microbatches",
    "8",
    "--costs",
    "1,1,1,0",
    "--replicas",
    "4",
    "--processes",
    "--json",
]
SLOW = ["--slow", "0:1:2"]


def emulate(unit_ms: float, tick_cost: float, table: str) -> dict:
    """One `pjit-pipe emulate` run of the case; its JSON object. `table`: "mitigated",
    "unmitigated" or "no slow worker"."""
    cmd = [sys.executable, "-m", "pjit_pipe", *CASE, "--unit-ms", f"{unit_ms:g}"]
    cmd += ["--tick-cost", f"{tick_cost:g}"]
    if table != "no slow worker":
        cmd += SLOW
    if table == "unmitigated":
        cmd.append("--unmitigated")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def excess_ms_a_tick(out: dict, unit_ms: float) -> float:
    """A run's measured period beyond its price, in ms a tick."""
    per_iteration = out["ticks"] / out["iterations"]
    return (out["measured_period"] - out["neighbor_period"]) * unit_ms / per_iteration


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unit-ms", default="40", help="ms a cost unit, comma-separated")
    parser.add_argument(
        "--tick-ms",
        default="auto",
        help="the machinery's ms a tick: auto (measured on the table with no slow worker) or a number",
    )
    args = parser.parse_args([] if argv is None else argv)
    print("1f1b D=4 P=4 m=8, 1,1,1,0, worker 0:1 at factor 2, on 16 processes")
    print(
        "U ms  round  table           ticks/it  event  neighbor price  measured  measured/price  "
        "ms a tick beyond"
    )

    def row(unit: float, k: int | str, name: str, out: dict) -> None:
        print(
            f"{unit:>4g}  {k:>5}  {name:<14} {out['ticks'] / out['iterations']:>9g} "
            f"{out['event_period']:>6g} {out['neighbor_period']:>15g} "
            f"{out['measured_period']:>9.2f} "
            f"{out['measured_period'] / out['neighbor_period']:>15.3f} "
            f"{excess_ms_a_tick(out, unit):>17.2f}",
            flush=True,
        )

    for unit in (float(u) for u in args.unit_ms.split(",")):
        if args.tick_ms == "auto":
            calibration = emulate(unit, 0.0, "no slow worker")
            row(unit, "-", "no slow worker", calibration)
            tick_ms = max(0.0, excess_ms_a_tick(calibration, unit))
        else:
            tick_ms = float(args.tick_ms)
        print(f"U = {unit:g} ms: tick cost {tick_ms:.2f} ms = {tick_ms / unit:.4g} units")
        to_price: list[float] = []
        to_unmitigated: list[float] = []
        for k in range(args.rounds):
            runs = {}
            for table in ("mitigated", "unmitigated")[:: 1 if k % 2 == 0 else -1]:
                runs[table] = emulate(unit, tick_ms / unit, table)
                row(unit, k, table, runs[table])
            mitigated = runs["mitigated"]["measured_period"]
            to_price.append(mitigated / runs["mitigated"]["neighbor_period"])
            to_unmitigated.append(mitigated / runs["unmitigated"]["measured_period"])
        print(f"U = {unit:g} ms: mitigated measured / price: {spread(to_price)}; target <= 1.10")
        print(
            f"U = {unit:g} ms: mitigated / unmitigated, measured: {spread(to_unmitigated)}; "
            "target <= 0.75"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
