"""`pjit-pipe schedule`: build, validate, price and draw one pipeline schedule."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from pjit_pipe.compiler import ScheduleSpec, build_schedule, build_table
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.serialize import to_json, to_text
from pjit_pipe.ir.slow import parse_slow
from pjit_pipe.schedules import KINDS
from pjit_pipe.simulator import SimResult, lockstep_lower_bound, simulate, slow_bound

DEFAULT_ITERATIONS = 4
PLOT_SUFFIXES = (".png", ".svg")


def _int_at_least(text: str, low: int, noun: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {noun} integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def tick_cost(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def costs_arg(text: str) -> Costs:
    try:
        costs = Costs.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--costs: ")) from None
    if not all(math.isfinite(x) for x in (costs.f, costs.b, costs.w, costs.c)):
        raise argparse.ArgumentTypeError(f"costs must be finite numbers, got {text!r}")
    return costs


def fused_costs_arg(text: str) -> tuple[float, ...]:
    """`--fused-costs F,BW[,FBW]`: two or three finite numbers >= 0."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers F,BW[,FBW], got {text!r}") from None
    if len(parts) not in (2, 3) or not all(0 <= x < math.inf for x in parts):
        raise argparse.ArgumentTypeError(
            f"expected two or three finite numbers F,BW[,FBW] >= 0, got {text!r}"
        )
    return tuple(parts)


def plot_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"file name must end in .png or .svg, got {text!r}")
    return path


def trace_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() != ".json":
        raise argparse.ArgumentTypeError(f"file name must end in .json, got {text!r}")
    return path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `schedule` subcommand."""
    p = subparsers.add_parser(
        "schedule",
        help="build, validate and simulate a pipeline schedule",
        description=__doc__.split(":", 1)[1].strip(),
    )
    p.add_argument("kind", metavar="KIND", choices=KINDS, help=f"one of {', '.join(KINDS)}")
    p.add_argument(
        "--stages",
        "-P",
        type=positive_int,
        required=True,
        metavar="P",
        help="pipeline stages (devices per replica)",
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        required=True,
        metavar="M",
        help="microbatches per iteration",
    )
    p.add_argument(
        "--chunks",
        "-v",
        type=positive_int,
        default=None,
        metavar="V",
        help="chunks (virtual stages) per device; default: the kind's own",
    )
    p.add_argument(
        "--costs",
        type=costs_arg,
        default=Costs(),
        metavar="F,B,W[,C]",
        help="times of F, B, W per microbatch and stage, and C per transfer (default 1,1,1,0)",
    )
    p.add_argument(
        "--fused-costs",
        type=fused_costs_arg,
        default=None,
        metavar="F,BW[,FBW]",
        help=(
            "times of F and of the fused backward BW of a stage the schedule does not split "
            "(default: F and B+W of --costs); with them, a stage whose split buys no time "
            "runs fused and the kind ends in '+fused'. FBW: the loss stage's F and backward "
            "as one program, which the compiled program runs where a tick holds both "
            "(default F + BW: no gain) (`pjit-pipe train --show-costs` measures them)"
        ),
    )
    p.add_argument(
        "--tick-cost",
        type=tick_cost,
        default=0.0,
        metavar="T",
        help=(
            "fixed time of one tick of the compiled loop, in the units of --costs: the packed "
            "table's lockstep_period pays it once per tick (default 0; `pjit-pipe train "
            "--show-costs` measures it)"
        ),
    )
    p.add_argument(
        "--mem-limit",
        type=positive_float,
        default=None,
        metavar="K",
        help="peak in-flight activations per worker, in microbatch-stage units",
    )
    p.add_argument(
        "--replicas", "-D", type=positive_int, default=1, help="data-parallel replicas D"
    )
    p.add_argument(
        "--failed",
        default="",
        metavar="R:S[,R:S...]",
        help="failed workers (replica:stage); their microbatches are re-routed to peers",
    )
    p.add_argument(
        "--slow",
        default="",
        metavar="R:S:FACTOR[,...]",
        help=(
            "slow workers: each op of worker R:S takes FACTOR (>= 1) times as long; part of "
            "their microbatches move to peers of their stage (--json adds slow_bound and "
            "unmitigated_period, the fault-free schedule's period at these speeds)"
        ),
    )
    p.add_argument(
        "--iterations",
        type=positive_int,
        default=DEFAULT_ITERATIONS,
        metavar="N",
        help=(
            "iterations simulated back to back; steady_period is their mean period "
            f"(default {DEFAULT_ITERATIONS}, enough for a pipeline to settle)"
        ),
    )
    p.add_argument(
        "--exact",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="auto only: improve the heuristic's schedule with the exact MILP engine",
    )
    p.add_argument(
        "--polish",
        type=positive_float,
        default=0.0,
        metavar="SECONDS",
        help=(
            "--json's lockstep_period: polish the packed tick table by exact solves of "
            "windows of its ticks, at most SECONDS each (not async-1f1b)"
        ),
    )
    p.add_argument(
        "--stagger",
        action="store_true",
        help="step each stage's optimizer as soon as its gradients are done (no barrier)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--plot",
        type=plot_path,
        metavar="FILE.png|FILE.svg",
        help="draw a Gantt chart of the simulated iterations",
    )
    p.add_argument(
        "--plot-ticks",
        type=plot_path,
        metavar="FILE.png|FILE.svg",
        help=(
            "draw the tick table the compiled program runs (packed under --costs, "
            "--tick-cost, --mem-limit and --polish), one band per tick; a loss-stage F and "
            "backward run as one op are cross-hatched"
        ),
    )
    p.add_argument(
        "--trace", type=trace_path, metavar="FILE.json", help="write a Chrome/Perfetto trace"
    )
    p.set_defaults(run=run)


def _summary_line(kind: str, result: SimResult) -> str:
    peak = ",".join(f"{v:g}" for v in result.summary()["peak_memory"])
    return (
        f"{kind}: makespan {result.makespan:g}  span {result.span:g}  ideal {result.ideal:g}  "
        f"bubble {result.bubble_ratio:.1%}  peak memory [{peak}]  "
        f"steady period {result.steady_period:g} over {result.iterations} iterations"
    )


def _slow_figures(spec: ScheduleSpec, costs, iterations: int) -> dict:
    """`slow_bound`, and `unmitigated_period`: the schedule built as if no worker were
    slow (the fault-free one, or re-routed around the failed workers only), priced
    at the slow workers' speeds."""
    unmitigated = build_schedule(dataclasses.replace(spec, slow=None), costs.with_slow({}))
    period = simulate(unmitigated, costs, iterations=iterations).steady_period
    bound = slow_bound(spec.stages, spec.microbatches, spec.replicas, None, spec.failed, costs)
    return {"slow_bound": round(bound, 9), "unmitigated_period": round(period, 9)}


def run(args: argparse.Namespace) -> int:
    """Build the schedule, validate it, simulate it, then print/draw/trace it."""
    failed = FailurePattern.parse(args.failed, args.replicas, args.stages)
    slow = parse_slow(args.slow, args.replicas, args.stages, failed.failed)
    if args.fused_costs is not None:
        f_fused, bw, *fbw = args.fused_costs
        args.costs = dataclasses.replace(
            args.costs, f_fused=f_fused, bw=bw, fbw=fbw[0] if fbw else None
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
        exact_time_limit=args.exact,
        slow=slow,
    )
    try:
        schedule = build_schedule(spec, args.costs)
    except ScheduleError as e:
        raise ScheduleError(str(e).replace("mem_limit ", "--mem-limit ", 1)) from None
    args.costs = args.costs.with_slow(slow)  # every price below is at the workers' speeds
    result = simulate(schedule, args.costs, iterations=args.iterations)
    if args.plot:
        from pjit_pipe.simulator import gantt

        gantt(
            result,
            args.plot,
            args.costs,
            title=f"{schedule.kind} P={schedule.stages} m={schedule.microbatches}",
        )
    if args.trace:
        from pjit_pipe.simulator import chrome_trace

        args.trace.write_text(json.dumps(chrome_trace(result)))
    if args.json or args.plot_ticks:
        costs = dataclasses.replace(args.costs, tick=args.tick_cost)
        ticks = build_table(schedule, costs, args.iterations, args.mem_limit, args.polish)
    if args.plot_ticks:
        from pjit_pipe.simulator import tick_gantt

        tick_gantt(
            ticks,
            args.plot_ticks,
            costs,
            title=f"{schedule.kind} P={schedule.stages} m={schedule.microbatches}",
        )
    if args.json:
        lockstep = simulate(schedule, costs, args.iterations, mode="lockstep", ticks=ticks)
        # Behind the barrier an iteration's table is priced alone, so no table's
        # lockstep_period is below this; staggered or asynchronous ones overlap.
        overlapping = schedule.staggered or schedule.asynchronous
        bound = None if overlapping else round(lockstep_lower_bound(schedule, costs), 9)
        out = {
            **result.summary(),
            "lockstep_period": round(lockstep.steady_period, 9),
            "lockstep_bound": bound,
            "kind": schedule.kind,
            "valid": True,
            "schedule": to_json(schedule),
        }
        if args.slow.strip():
            out.update(_slow_figures(spec, args.costs, args.iterations))
        print(json.dumps(out))
    else:
        print(to_text(schedule), end="")
        print(_summary_line(schedule.kind, result))
    return 0
