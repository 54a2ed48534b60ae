"""Emulated runs of the lockstep grid: what each runtime pays for its tick table.

For each case (bench_lockstep's grid: every kind at P=4 m=8 and P=8 m=32
under 1,1,1,0, 1,2,1,0 and 5,6,4,1, and re-routed zb-h1 on 4x4 m=8 with one
and two failures), two tables are packed within the schedule's own peak:
one for global lockstep, run in one process on D*P CPU devices, and one for
neighbour-synchronous ticks, run on D*P processes of one device each over
gloo (runtime/emulation.py, runtime/emulate_processes.py). Each table's
three prices (event-driven steady period, global lockstep, neighbour-
synchronous) and its measured period (median of the iterations after the
first, over `--iterations`), all in cost units, and the measured period over
the price of its own runtime. Every op sleeps cost x --unit-ms; the
machinery of each tick (its callbacks, conditionals and ppermutes) is real
and adds to it: `--overhead` also runs each table with sleeps of 1/1000 of
that, which measures the machinery alone (ms per tick), and `--cross` runs
the table packed for neighbour-synchronous ticks in one process too.

    python -m benchmarks.bench_emulate                      # P=4 m=8, 1,2,1,0 and 5,6,4,1
    python -m benchmarks.bench_emulate --full               # the whole grid (hours)
    python -m benchmarks.bench_emulate --kinds 1f1b --sizes 8x32 --costs 5,6,4,1
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench_lockstep import COSTS, kind_cases, rerouted_cases

from pjit_pipe.ir.costs import Costs
from pjit_pipe.runtime.emulate_processes import emulate_processes
from pjit_pipe.runtime.emulation import emulate_in_process
from pjit_pipe.simulator.simulate import simulate
from pjit_pipe.tick_packing.packer import pack_ticks


def prices(table, costs: Costs) -> tuple[float, float]:
    s, n = table.schedule, table.iterations
    run = lambda sync: simulate(s, costs, n, mode="lockstep", ticks=table, sync=sync)  # noqa: E731
    return run("global").steady_period, run("neighbor").steady_period


def row(label, sched, costs_text, args) -> str:
    costs = Costs.parse(costs_text)
    n = args.iterations
    event = simulate(sched, costs, n).steady_period
    cells = [label, costs_text, f"{event:g}"]
    for sync, runtime in (("global", "in-process"), ("neighbor", "processes")):
        if runtime not in args.runtimes:
            cells += ["-"] * 4
            continue
        table = pack_ticks(sched, costs, n, sync=sync)
        lockstep, neighbor = prices(table, costs)
        own = lockstep if sync == "global" else neighbor
        run = emulate_in_process if sync == "global" else emulate_processes
        measured = run(table, costs, args.unit_ms)
        cells += [f"{lockstep:g}", f"{neighbor:g}", f"{measured:.1f}", f"{measured / own:.3f}"]
        if args.cross and sync == "neighbor":  # the same table in one process
            cells[-1] += f" (in one process: {emulate_in_process(table, costs, args.unit_ms):.1f})"
        if args.overhead:
            idle = run(table, costs, args.unit_ms / 1000) * args.unit_ms / 1000
            cells[-1] += f" ({idle * n / len(table):.1f} ms/tick)"
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the whole grid (every size and cost)")
    p.add_argument("--sizes", default="4x8", help="PxM,... (default 4x8; the grid: 4x8,8x32)")
    p.add_argument("--costs", default="1,2,1,0;5,6,4,1", help="cost lists, ';'-separated")
    p.add_argument("--kinds", default="", help="kinds, comma-separated (default: all)")
    p.add_argument("--rerouted", action="store_true", help="also re-routed zb-h1 on 4x4")
    p.add_argument("--runtimes", default="in-process,processes")
    p.add_argument("--unit-ms", type=float, default=20.0)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--overhead", action="store_true", help="also time the machinery alone")
    p.add_argument(
        "--cross", action="store_true", help="also run the neighbour-packed table in one process"
    )
    args = p.parse_args()
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
    wanted = set(COSTS if args.full else args.costs.split(";"))
    kinds = set(args.kinds.split(",")) if args.kinds else None
    if args.full:
        sizes, args.rerouted = [(4, 8), (8, 32)], True
    print(
        "| case | costs | event | in-process: lockstep | neighbor | measured | / lockstep "
        "| processes: lockstep | neighbor | measured | / neighbor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [
        c
        for c in kind_cases(sizes, with_async=False)
        if c[2] in wanted and (kinds is None or c[1].kind in kinds)
    ]
    if args.rerouted:
        cases += [c for c in rerouted_cases() if c[2] in wanted]
    for label, sched, costs_text in cases:
        start = time.perf_counter()
        line = row(label, sched, costs_text, args)
        print(f"{line} <!-- {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
