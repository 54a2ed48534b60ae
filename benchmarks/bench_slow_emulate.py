"""Emulated slow workers, one process per device: measured period against its price.

The issue 40 case: 1F1B, D=4, P=4, m=8, unit costs, worker 0:1 at factor 2,
one process per device (`pjit-pipe emulate --processes`, neighbour-
synchronous ticks), U = 40 ms a cost unit. Each round runs the mitigated
table and the unmitigated (fault-free) one, in alternating order, with the
same command the CLI documents:

    pjit-pipe emulate 1f1b --stages 4 --microbatches 8 --costs 1,1,1,0 --replicas 4
        --slow 0:1:2 --unit-ms 40 --processes --json [--unmitigated]

and prints each table's measured period, its price (`neighbor_period`, the
price of the multi-controller runtime) and the ratios: measured / price and
mitigated / unmitigated measured. The targets: mitigated within 1.10 x its
price, and at most 0.75 x the unmitigated measured period.

`--machinery` also runs each table once with sleeps of U/1000, so that what
it measures is the tick's machinery alone (its callbacks, conditionals and
gloo ppermutes); divided by the table's ticks per iteration it gives ms per
tick. The price plus (ticks per iteration) x (machinery per tick) / U is
then what the run should cost, and the rest is noise.

Run: python -m benchmarks.bench_slow_emulate [--rounds 3] [--unit-ms 40] [--machinery]
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
    "--slow",
    "0:1:2",
    "--processes",
    "--json",
]


def emulate(unit_ms: float, unmitigated: bool) -> dict:
    """One `pjit-pipe emulate` run of the case; its JSON object."""
    cmd = [sys.executable, "-m", "pjit_pipe", *CASE, "--unit-ms", f"{unit_ms:g}"]
    if unmitigated:
        cmd.append("--unmitigated")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--unit-ms", type=float, default=40.0)
    parser.add_argument("--machinery", action="store_true", help="also time the machinery alone")
    args = parser.parse_args([] if argv is None else argv)
    unit = args.unit_ms
    print(f"1f1b D=4 P=4 m=8, 1,1,1,0, worker 0:1 at factor 2, U = {unit:g} ms, on 16 processes")
    print("round  table        ticks/it  event  neighbor price  measured  measured/price")
    to_price: list[float] = []
    to_unmitigated: list[float] = []
    last: dict[bool, dict] = {}
    for k in range(args.rounds):
        runs = {}
        for unmitigated in (False, True) if k % 2 == 0 else (True, False):
            runs[unmitigated] = out = emulate(unit, unmitigated)
            name = "unmitigated" if unmitigated else "mitigated"
            ratio = out["measured_period"] / out["neighbor_period"]
            print(
                f"{k:>5}  {name:<11} {out['ticks'] / out['iterations']:>9g} "
                f"{out['event_period']:>6g} {out['neighbor_period']:>15g} "
                f"{out['measured_period']:>9.2f} {ratio:>15.3f}",
                flush=True,
            )
        to_price.append(runs[False]["measured_period"] / runs[False]["neighbor_period"])
        to_unmitigated.append(runs[False]["measured_period"] / runs[True]["measured_period"])
        last = runs
    print(f"mitigated measured / price: {spread(to_price)}; target <= 1.10")
    print(f"mitigated / unmitigated, measured: {spread(to_unmitigated)}; target <= 0.75")
    if not args.machinery:
        return
    tiny = unit / 1000
    for unmitigated in (False, True):
        out = emulate(tiny, unmitigated)
        per_it = out["ticks"] / out["iterations"]
        tick_ms = out["measured_period"] * tiny / per_it
        run = last[unmitigated]
        predicted = run["neighbor_period"] + per_it * tick_ms / unit
        name = "unmitigated" if unmitigated else "mitigated"
        print(
            f"{name}: machinery {tick_ms:.2f} ms a tick x {per_it:g} ticks an iteration = "
            f"{per_it * tick_ms / unit:.2f} units; price + machinery {predicted:.2f} "
            f"against the last measured {run['measured_period']:.2f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
