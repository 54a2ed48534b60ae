"""The arguments of `pjit-pipe train`: parsers, help texts and the check of a
failure plan, kept apart from the training loop (train.py) they configure.

Nothing here imports JAX: the CLI parses and checks everything before the
device count is fixed.
"""

from __future__ import annotations

import argparse
import re

MODELS = ("gpt-tiny", "mlp")


def mesh_arg(text: str) -> tuple[int, int, int]:
    """Parse DxP or DxPxT (data replicas x pipeline stages x tensor), e.g. 2x4 or
    2x2x2; T defaults to 1."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?", text.strip())
    if not match or min(int(g) for g in match.groups(default="1")) < 1:
        raise argparse.ArgumentTypeError(
            f"expected DxP or DxPxT with positive integers, got {text!r}"
        )
    return int(match[1]), int(match[2]), int(match[3] or 1)


def step_workers_arg(text: str) -> dict[int, list[tuple[int, int]]]:
    """Parse STEP:R:S[,STEP:R:S...] (worker (R, S) at step STEP) into {step: [(R, S), ...]}."""
    out: dict[int, list[tuple[int, int]]] = {}
    for token in filter(None, (t.strip() for t in text.split(","))):
        match = re.fullmatch(r"(\d+):(\d+):(\d+)", token)
        if not match:
            raise argparse.ArgumentTypeError(
                f"expected STEP:R:S[,STEP:R:S...] with non-negative integers, got {token!r}"
            )
        step, r, s = map(int, match.groups())
        out.setdefault(step, []).append((r, s))
    return out


def check_failure_plan(
    fail: dict[int, list[tuple[int, int]]],
    rejoin: dict[int, list[tuple[int, int]]],
    data: int,
    stages: int,
    steps: int,
    down: list[tuple[int, int]] | tuple = (),
    start: int = 0,
) -> None:
    """Refuse, before anything compiles, a plan of failures and rejoins that cannot
    run (`pjit_pipe.ir.failures.check_failure_plan`, played from step `start`
    with the workers `down` down: a resumed run), as a UsageError naming the flag."""
    from pjit_pipe.cli import UsageError
    from pjit_pipe.errors import FailurePlanError
    from pjit_pipe.ir.failures import check_failure_plan as check_plan

    try:
        check_plan(fail, rejoin, data, stages, steps, down, start, ("--fail", "--rejoin"))
    except FailurePlanError as e:
        raise UsageError(str(e)) from e


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by `train` and `demo`."""
    from pjit_pipe.cli.schedule_command import positive_float, positive_int
    from pjit_pipe.schedules import KINDS

    parser.add_argument(
        "--model",
        choices=MODELS,
        default="gpt-tiny",
        help="the example model: a tiny character-level GPT on a bundled text, or a "
        "residual MLP regressing a random teacher (default gpt-tiny)",
    )
    parser.add_argument(
        "--mesh",
        type=mesh_arg,
        default=(1, 4),
        metavar="DxP[xT]",
        help="D data-parallel replicas x P pipeline stages [x T tensor-parallel devices per "
        "stage] (default 1x4); needs D*P*T devices. With T > 1 gpt-tiny splits its blocks' "
        "weights Megatron-style (docs/tensor_parallel.md)",
    )
    parser.add_argument(
        "--schedule",
        choices=KINDS,
        default="1f1b",
        metavar="KIND",
        help=f"pipeline schedule, one of {', '.join(KINDS)} (default 1f1b)",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=4,
        metavar="M",
        help="microbatches per replica per step (default 4)",
    )
    parser.add_argument(
        "--chunks",
        type=positive_int,
        default=None,
        metavar="V",
        help="chunks (virtual stages) per device; default: the kind's own (2 for zb-v "
        "and interleaved-1f1b, else 1)",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        metavar="B",
        help="global batch, a multiple of D*M (default 2*D*M)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=100, metavar="N", help="steps to run (default 100)"
    )
    parser.add_argument(
        "--lr", type=positive_float, default=3e-3, help="Adam learning rate (default 3e-3)"
    )
    parser.add_argument(
        "--clip",
        type=positive_float,
        default=None,
        metavar="NORM",
        help="clip the gradient's global norm to NORM before Adam (optax.clip_by_global_norm)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the parameters and the data: a run is repeatable (default 0)",
    )
    parser.add_argument(
        "--async-weights",
        choices=("predict", "stash", "latest"),
        default=None,
        help="--schedule async-1f1b only: the weights its stale forwards read: predict "
        "(PipeOptim's weight prediction, the default), stash (PipeDream's weight "
        "stashing) or latest; each of the M microbatches of a step is one Adam update",
    )
    parser.add_argument(
        "--zero",
        type=int,
        nargs="?",
        const=1,
        default=0,
        choices=(0, 1, 3),
        metavar="0|1|3",
        help="ZeRO over the data axis: 1 (--zero alone) shards each stage's Adam state over "
        "its D replicas, 3 its parameters too, 0 (the default) neither (unstaggered "
        "schedules; docs/memory.md)",
    )
    parser.add_argument(
        "--grad-sum",
        choices=("accumulator", "slices", "slices-compute"),
        default="accumulator",
        help="with --zero: sum the microbatches' gradients in one float32 accumulator, "
        "reduce-scattered once (the default), or reduce-scatter each into float32 slices "
        "(1/D of the bytes, one reduce-scatter per microbatch), slices-compute: those "
        "reduce-scatters in the compute dtype (bf16 sums; docs/memory.md)",
    )


def slow_events_arg(text: str) -> dict:
    """Parse STEP:R:S:FACTOR[,...] (worker (R, S) runs FACTOR times slower from step
    STEP on; FACTOR 1: it recovers) into {step: {Worker: factor}}."""
    from pjit_pipe.errors import FailurePlanError
    from pjit_pipe.ir.slow import parse_slow_events

    try:
        return parse_slow_events(text)
    except FailurePlanError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--slow: ")) from None


def check_slow_plan(plan: dict, data: int, stages: int, steps: int) -> None:
    """Refuse, before anything compiles, a --slow plan with a worker outside the
    mesh or a step past the last, as a UsageError naming the flag."""
    from pjit_pipe.cli import UsageError

    for step, workers in sorted(plan.items()):
        for r, s in workers:
            if not (0 <= r < data and 0 <= s < stages):
                raise UsageError(
                    f"--slow: worker {r}:{s} at step {step} is outside the mesh {data}x{stages} "
                    f"(R < {data}, S < {stages})"
                )
        if step >= steps:
            raise UsageError(
                f"--slow: step {step} is past the last step ({steps} steps run steps "
                f"0-{steps - 1}); use a step below {steps} or raise --steps"
            )


def add_failure_args(parser: argparse.ArgumentParser) -> None:
    """Injected failures and rejoins, and how many failures to precompile for."""
    from pjit_pipe.cli.schedule_command import nonneg_int

    parser.add_argument(
        "--fail",
        type=step_workers_arg,
        default={},
        metavar="STEP:R:S[,...]",
        help="worker (R, S) dies during step STEP (the step is retried on its peers)",
    )
    parser.add_argument(
        "--rejoin",
        type=step_workers_arg,
        default={},
        metavar="STEP:R:S[,...]",
        help="worker (R, S) is back before step STEP",
    )
    parser.add_argument(
        "--slow",
        type=slow_events_arg,
        default={},
        metavar="STEP:R:S:FACTOR[,...]",
        help=(
            "worker (R, S) runs FACTOR (>= 1) times slower from step STEP on (1: it has "
            "recovered); the program that moves part of its microbatches to peers runs then"
        ),
    )
    parser.add_argument(
        "--precompile",
        type=nonneg_int,
        default=None,
        metavar="K",
        help="compile variants for up to K failed workers in the background "
        "(default 1 with --fail, else 0); with --slow, the plan's slow workers and "
        "each single slow worker at factor 2 compile there too",
    )


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """Where to save checkpoints (and resume from), and how often."""
    from pjit_pipe.cli.schedule_command import positive_int

    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save checkpoints here (orbax); a DIR holding one resumes after its latest step",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=100,
        metavar="N",
        help="save every N steps and at the end (default 100)",
    )


def add_process_args(parser: argparse.ArgumentParser) -> None:
    """A run of several local processes over `jax.distributed` (cli/train_processes.py)."""
    from pjit_pipe.cli.schedule_command import positive_int

    parser.add_argument(
        "--processes",
        type=positive_int,
        default=None,
        metavar="N",
        help="train on N local processes over jax.distributed (gloo on CPU), plus one that "
        "only hosts the coordination service; the mesh spans their devices, and a process "
        "that dies is trained around (docs/multiprocess.md)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=positive_int,
        default=None,
        metavar="K",
        help="with --processes: CPU devices of each process (default: the mesh's devices / N)",
    )
    parser.add_argument(
        "--events",
        default=None,
        metavar="FILE",
        help="with --processes: append one JSON line per event (process start, committed "
        "step, failure, switch, rejoin) to FILE, each with 't' in unix seconds",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="with --processes: when a training process dies, the survivors stop together "
        "at a step, save it, and the whole job restarts from there with every process (the "
        "dead one rejoins); when the coordinator dies, the job restarts from the newest "
        "checkpoint. Saves in --checkpoint-dir (default: a temporary folder)",
    )


def check_process_args(args: argparse.Namespace) -> int:
    """The devices per process of a --processes run, after refusing what it cannot run
    (as a UsageError naming the flag).

    Returns:
        K: the mesh's devices are N processes x K devices.
    """
    from pjit_pipe.cli import UsageError

    data, stages, tensor = args.mesh
    need, n = data * stages * tensor, args.processes
    k = args.devices_per_process
    if k is None:
        if need % n:
            raise UsageError(
                f"--processes {n}: the mesh's {need} devices do not split evenly over {n} "
                f"processes; use a divisor of {need}, or give --devices-per-process"
            )
        k = need // n
    if n * k != need:
        raise UsageError(
            f"--processes {n} x --devices-per-process {k} = {n * k} devices, but --mesh "
            f"{data}x{stages}x{tensor} needs {need}; make N x K equal D x P x T"
        )
    for flag, value in (("--fail", args.fail), ("--rejoin", args.rejoin), ("--slow", args.slow)):
        if value:
            raise UsageError(
                f"{flag} injects events into one process; with --processes the failures are "
                "real (kill a process): drop it"
            )
    if (args.checkpoint_dir or args.restart) and k % tensor:
        flag = (
            "--checkpoint-dir"
            if args.checkpoint_dir
            else "--restart (it restarts from a checkpoint)"
        )
        raise UsageError(
            f"{flag} with --processes: each process saves the workers it holds, but with "
            f"--devices-per-process {k} a worker's {tensor} 'tensor' devices span processes; "
            f"give each process a multiple of {tensor} devices"
        )
    if args.schedule == "async-1f1b" or args.show_costs:
        what = "--schedule async-1f1b" if args.schedule == "async-1f1b" else "--show-costs"
        raise UsageError(f"{what} runs in one process only; drop --processes")
    return k
