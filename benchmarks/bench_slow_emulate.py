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

Where the excess over the price goes: the last column spreads it over the
table's ticks, (measured - price) x U / (ticks an iteration), in ms a tick.
A fixed cost a tick (callbacks, conditionals, gloo ppermutes, the sleeps'
late wake-ups) gives the same ms a tick for both tables and at every U, so
the excess in units shrinks as 1/U: give several units (`--unit-ms 40,80`)
to check. (Sleeps of U/1000 would time the machinery alone, but 16
processes that never sleep then contend for the host's cores, which the
sleeping runs do not.)

Run: python -m benchmarks.bench_slow_emulate [--rounds 3] [--unit-ms 40[,80...]]
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
    parser.add_argument("--unit-ms", default="40", help="ms a cost unit, comma-separated")
    args = parser.parse_args([] if argv is None else argv)
    print("1f1b D=4 P=4 m=8, 1,1,1,0, worker 0:1 at factor 2, on 16 processes")
    print(
        "U ms  round  table        ticks/it  event  neighbor price  measured  measured/price  "
        "ms a tick beyond"
    )
    for unit in (float(u) for u in args.unit_ms.split(",")):
        to_price: list[float] = []
        to_unmitigated: list[float] = []
        for k in range(args.rounds):
            runs = {}
            for unmitigated in (False, True) if k % 2 == 0 else (True, False):
                runs[unmitigated] = out = emulate(unit, unmitigated)
                name = "unmitigated" if unmitigated else "mitigated"
                per_it = out["ticks"] / out["iterations"]
                excess = out["measured_period"] - out["neighbor_period"]
                print(
                    f"{unit:>4g}  {k:>5}  {name:<11} {per_it:>9g} {out['event_period']:>6g} "
                    f"{out['neighbor_period']:>15g} {out['measured_period']:>9.2f} "
                    f"{out['measured_period'] / out['neighbor_period']:>15.3f} "
                    f"{excess * unit / per_it:>17.2f}",
                    flush=True,
                )
            to_price.append(runs[False]["measured_period"] / runs[False]["neighbor_period"])
            to_unmitigated.append(runs[False]["measured_period"] / runs[True]["measured_period"])
        print(f"U = {unit:g} ms: mitigated measured / price: {spread(to_price)}; target <= 1.10")
        print(
            f"U = {unit:g} ms: mitigated / unmitigated, measured: {spread(to_unmitigated)}; "
            "target <= 0.75"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
