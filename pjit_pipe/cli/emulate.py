"""`pjit-pipe emulate`: time the compiled tick program with each op sleeping its price.

The schedule is built and packed as `pjit-pipe schedule` does, then compiled
with every op's compute replaced by a host callback that sleeps cost x
--unit-ms (runtime/emulation.py), and run for --iterations iterations: on
D*P CPU devices of this process, or with --processes on D*P processes of one
device each over gloo (runtime/emulate_processes.py). It prints the three
prices of the table and the measured steady period, in cost units.

With --slow R:S:FACTOR the ops of worker R:S sleep FACTOR times longer; the
table is the mitigated one (part of the slow workers' microbatches moved to
peers, packed at those speeds), or with --unmitigated the fault-free table.

--tick-cost T prices (and packs) the table with a fixed cost of T units a
tick, as `pjit-pipe schedule --tick-cost` does: the machinery a tick runs
besides its ops (callbacks, conditionals, ppermutes), which the sleeps do
not include. Nothing sleeps it; it only enters the lockstep and neighbour
prices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from pjit_pipe.cli.device_choice import ensure_host_devices
from pjit_pipe.cli.schedule_command import costs_arg, positive_float, positive_int, tick_cost
from pjit_pipe.compiler import ScheduleSpec, build_schedule, build_table
from pjit_pipe.errors import OptionError
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.slow import parse_slow
from pjit_pipe.schedules import KINDS
from pjit_pipe.simulator import SYNCS, simulate

DEFAULT_ITERATIONS = 4
DEFAULT_UNIT_MS = 20.0


def iterations_arg(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be >= 2 (the period is measured after the first iteration), got {value}"
        )
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `emulate` subcommand."""
    p = subparsers.add_parser(
        "emulate",
        help="time the compiled tick program with each op sleeping its price",
        description=__doc__.split(":", 1)[1].strip(),
    )
    p.add_argument("kind", metavar="KIND", choices=KINDS, help=f"one of {', '.join(KINDS)}")
    p.add_argument("--stages", "-P", type=positive_int, required=True, metavar="P")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True, metavar="M")
    p.add_argument(
        "--costs",
        type=costs_arg,
        required=True,
        metavar="F,B,W,C",
        help="times of F, B, W per microbatch and stage, and C per transfer",
    )
    p.add_argument("--chunks", "-v", type=positive_int, default=None, metavar="V")
    p.add_argument("--replicas", "-D", type=positive_int, default=1, metavar="D")
    p.add_argument("--failed", default="", metavar="R:S[,R:S...]", help="failed workers")
    p.add_argument(
        "--slow",
        default="",
        metavar="R:S:FACTOR[,...]",
        help="slow workers: each op of worker R:S sleeps FACTOR (>= 1) times longer",
    )
    p.add_argument(
        "--unmitigated",
        action="store_true",
        help="with --slow: run the fault-free table, not the one that moves work off slow workers",
    )
    p.add_argument("--stagger", action="store_true", help="stagger the optimizer steps")
    p.add_argument(
        "--iterations",
        type=iterations_arg,
        default=DEFAULT_ITERATIONS,
        metavar="N",
        help=f"iterations run back to back, at least 2 (default {DEFAULT_ITERATIONS})",
    )
    p.add_argument("--mem-limit", type=positive_float, default=None, metavar="K")
    p.add_argument(
        "--tick-cost",
        type=tick_cost,
        default=0.0,
        metavar="T",
        help="the fixed cost of a tick in cost units, priced and packed for, not slept (default 0)",
    )
    p.add_argument(
        "--unit-ms",
        type=positive_float,
        default=DEFAULT_UNIT_MS,
        metavar="U",
        help=f"milliseconds one cost unit sleeps (default {DEFAULT_UNIT_MS:g})",
    )
    p.add_argument(
        "--processes",
        action="store_true",
        help="one process per device over gloo (multi-controller), not one process",
    )
    p.add_argument(
        "--pack-for",
        choices=SYNCS,
        default=None,
        help=(
            "the price the table is packed for: global lockstep or neighbour-synchronous "
            "(default: neighbor with --processes, else global)"
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def build(args: argparse.Namespace) -> Schedule:
    """The (possibly staggered) schedule the arguments ask for, validated, by the
    compile path every other caller uses (`compiler.build_schedule`): with --slow,
    the mitigated one unless --unmitigated."""
    failed = FailurePattern.parse(args.failed, args.replicas, args.stages)
    slow = parse_slow(args.slow, args.replicas, args.stages, failed.failed)
    if args.unmitigated and not slow:
        raise OptionError(
            "--unmitigated runs the fault-free table at the speeds of --slow; give --slow "
            "R:S:FACTOR too, or drop --unmitigated"
        )
    spec = ScheduleSpec(
        args.kind,
        args.stages,
        args.microbatches,
        args.chunks,
        args.replicas,
        failed,
        args.mem_limit,
        args.stagger,
        slow=None if args.unmitigated else slow,
    )
    if spec.kind == "async-1f1b":
        raise OptionError(
            f"emulate: kind {args.kind} is asynchronous, whose program carries messages "
            "across calls; emulate a synchronous kind"
        )
    try:
        return build_schedule(spec, args.costs)
    except ScheduleError as e:
        raise ScheduleError(str(e).replace("mem_limit ", "--mem-limit ", 1)) from None


def run(args: argparse.Namespace) -> int:
    """Build, pack, price and run the emulated program; print the figures."""
    schedule = build(args)
    slow = parse_slow(args.slow, args.replicas, args.stages, schedule.failed)
    # The unmitigated table is packed as if every worker were healthy; both run
    # (and are priced) at the slow workers' speeds.
    given = dataclasses.replace(args.costs, tick=args.tick_cost)
    packed_for: Costs = given if args.unmitigated else given.with_slow(slow)
    costs: Costs = given.with_slow(slow)
    n = args.iterations
    sync = args.pack_for or ("neighbor" if args.processes else "global")
    table = build_table(schedule, packed_for, n, args.mem_limit, sync=sync)
    event = simulate(schedule, costs, n).steady_period
    lockstep = simulate(schedule, costs, n, mode="lockstep", ticks=table).steady_period
    neighbor = simulate(schedule, costs, n, mode="lockstep", ticks=table, sync="neighbor")
    if args.processes:
        from pjit_pipe.runtime import emulate_processes

        measured = emulate_processes(table, costs, args.unit_ms)
        runtime = "multi-controller"
    else:
        ensure_host_devices(schedule.replicas * schedule.stages)
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the ops sleep on host devices
        from pjit_pipe.runtime import emulate_in_process

        measured = emulate_in_process(table, costs, args.unit_ms)
        runtime = "in-process"
    out = {
        "kind": schedule.kind,
        "event_period": round(event, 9),
        "lockstep_period": round(lockstep, 9),
        "neighbor_period": round(neighbor.steady_period, 9),
        "measured_period": round(measured, 6),
        "runtime": runtime,
        "packed_for": sync,
        "iterations": n,
        "unit_ms": args.unit_ms,
        "ticks": len(table),
        "tick_cost": args.tick_cost,
        "slow": {str(w): f for w, f in costs.slow},
        "unmitigated": args.unmitigated,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"{schedule.kind}: event {event:g}  lockstep {lockstep:g}  "
            f"neighbor {neighbor.steady_period:g}  measured {measured:.3f} ({runtime}, "
            f"packed for {sync}, {len(table)} ticks, {n} iterations, {args.unit_ms:g} ms a unit)"
        )
    return 0
