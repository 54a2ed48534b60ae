"""`pjit-pipe plan`: partition a profiled model into stages and map them onto devices.

Reads a layer profile and a devices description, searches the contiguous
partition, the D x P device mapping and the schedule kind that minimise the
iteration period under the planner's cost model (pjit_pipe.planner), and
prints the plan; or, with --evaluate, prices given plans.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pjit_pipe.cli.schedule_command import plot_path, positive_int
from pjit_pipe.planner import (
    PLANNABLE_KINDS,
    CostModel,
    Evaluation,
    Plan,
    PlanError,
    load_devices,
    load_profile,
    plan_model,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="partition a profiled model into stages and map them onto devices",
        description=__doc__.split(":", 1)[1].strip(),
    )
    p.add_argument("--profile", required=True, metavar="FILE", help="DAPPLE text or JSON profile")
    p.add_argument(
        "--devices", required=True, metavar="FILE.json", help="bandwidth, memory, speed (JSON)"
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        required=True,
        metavar="M",
        help="microbatches per replica per iteration",
    )
    p.add_argument("--stages", "-P", type=positive_int, metavar="P", help="default: chosen")
    p.add_argument("--replicas", "-D", type=positive_int, metavar="D", help="default: chosen")
    p.add_argument(
        "--schedule",
        metavar="KIND",
        help=f"one of {', '.join(PLANNABLE_KINDS)}; default: chosen",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot",
        type=plot_path,
        metavar="FILE.png|FILE.svg",
        help="draw the device graph with the stages on it, next to the Gantt chart",
    )
    p.add_argument(
        "--evaluate",
        metavar="PLANS.json",
        help='price a JSON list of {"stages", "mapping", "schedule"?} plans instead of searching',
    )
    p.set_defaults(run=run)


def _plans(path: str, default_kind: str | None) -> list[Plan]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError(f"--evaluate: cannot read {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise PlanError(f"--evaluate: {path}:{e.lineno}: malformed JSON: {e.msg}") from None
    if isinstance(data, dict) and "plans" in data:
        data = data["plans"]
    if not isinstance(data, list):
        raise PlanError(
            f'--evaluate: expected a JSON list of {{"stages", "mapping"}} plans in {path}'
        )
    plans = []
    for k, item in enumerate(data):
        where = f"--evaluate: plan {k}"
        if not isinstance(item, dict) or "stages" not in item or "mapping" not in item:
            raise PlanError(
                f'{where}: expected {{"stages": [[first, last], ...], "mapping": [[device, ...], ...]}}'
            )
        stages, mapping = item["stages"], item["mapping"]
        if not isinstance(stages, list) or not all(
            isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in stages
        ):
            raise PlanError(f"{where}: stages must be a list of [first, last] integer pairs")
        if not isinstance(mapping, list) or not all(isinstance(r, list) for r in mapping):
            raise PlanError(f"{where}: mapping must be a list of D rows of device ids")
        kind = item.get("schedule", default_kind or PLANNABLE_KINDS[0])
        plans.append(Plan(tuple(map(tuple, stages)), tuple(map(tuple, mapping)), kind))
    return plans


def _check_shape(args: argparse.Namespace, layers: int, devices: int) -> None:
    if args.schedule is not None and args.schedule not in PLANNABLE_KINDS:
        raise PlanError(
            f"--schedule {args.schedule!r}: the planner places one contiguous stage per "
            f"device; choose one of {', '.join(PLANNABLE_KINDS)}"
        )
    D, P = args.replicas or 1, args.stages or 1
    if devices < D * P:
        raise PlanError(
            f"--replicas {D} x --stages {P} = {D * P} devices, but --devices describes "
            f"only {devices}"
        )
    if layers < P:
        raise PlanError(f"--stages {P} is more than the profile's {layers} layers")


def _as_json(model: CostModel, ev: Evaluation) -> dict:
    return {
        **ev.plan.to_json(),
        "period": ev.period,
        "memory": list(ev.memory),
        "replicas": ev.plan.replicas,
        "layers": list(model.profile.names),
    }


def _text(model: CostModel, ev: Evaluation) -> str:
    names = model.profile.names
    lines = [
        f"plan: {ev.plan.num_stages} stages x {ev.plan.replicas} replicas, schedule "
        f"{ev.plan.schedule}, period {ev.period:.3f} ms per iteration"
    ]
    for p, (first, last) in enumerate(ev.plan.stages):
        devs = ",".join(str(row[p]) for row in ev.plan.mapping)
        mem = max(ev.memory[row[p]] for row in ev.plan.mapping)
        lines.append(
            f"  stage {p}: layers {first}-{last} ({names[first][:30]} .. {names[last][:30]}) "
            f"on devices {devs}, {mem / 1e9:.2f} GB each"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Search (or price) plans and print them."""
    profile = load_profile(args.profile)
    devices = load_devices(args.devices)
    _check_shape(args, len(profile), len(devices))
    model = CostModel(profile, devices, args.microbatches)
    if args.evaluate:
        out = []
        for plan in _plans(args.evaluate, args.schedule):
            ev = model.evaluate(plan)
            out.append({"period": ev.period, "memory": list(ev.memory)})
        print(json.dumps({"plans": out}))
        return 0
    ev = plan_model(model, stages=args.stages, replicas=args.replicas, schedule=args.schedule)
    if args.plot:
        from pjit_pipe.planner import draw_plan

        draw_plan(model, ev.plan, args.plot)
    print(json.dumps(_as_json(model, ev)) if args.json else _text(model, ev))
    return 0
