"""`pjit-pipe demo` (`make demo`): train the tiny GPT on 8 CPU devices and show the result.

data=2 x stage=4 with the ZB-H1 schedule: a progress bar with loss, tokens/s
and the failure variants compiled so far. Training starts once the
fault-free step is compiled; every single-worker failure variant compiles in
the background meanwhile, the one the failure needs first. A third of the way
in, worker 1:2 fails, its microbatches move to its peer 0:2 on the
precompiled program (the demo says so if it has to wait for that program),
and at two thirds it rejoins. Compiled programs are kept on disk (see
`--cache-dir`), so a later demo loads them instead of compiling them again;
variants still compiling when training ends are left for the next run. Written
to files: the schedule's Gantt chart, the re-routed schedule's, and the loss
curve with the failure and the rejoin marked. Last, a text sample.
"""

from __future__ import annotations

import argparse
from typing import Any

from pjit_pipe.cli.compile_cache import add_cache_args
from pjit_pipe.cli.device_choice import ensure_host_devices, run_devices
from pjit_pipe.cli.train_args import mesh_arg

GANTT_FILE = "demo_schedule.png"
REROUTED_FILE = "demo_rerouted.png"
LOSS_FILE = "demo_loss.png"
FAILED_WORKER = (1, 2)


def loss_curve(losses: list[float], marks: dict[int, str], path: str) -> str:
    """Loss per step, with a dashed line and a label at each marked step."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(range(len(losses)), losses, lw=1.2)
    for step, label in sorted(marks.items()):
        ax.axvline(step, color="#e15759" if label == "failure" else "#59a14f", ls="--", lw=1)
        ax.annotate(label, (step, max(losses)), xytext=(3, -12), textcoords="offset points")
    ax.set(xlabel="step", ylabel="loss", title="Training through a failure and a rejoin")
    fig.savefig(path, dpi=120)
    return path


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="train the tiny GPT on 8 CPU devices", description=__doc__
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--gantt", default=GANTT_FILE, help="where to save the schedule chart")
    parser.add_argument(
        "--rerouted", default=REROUTED_FILE, help="where to save the re-routed schedule's chart"
    )
    parser.add_argument("--loss-plot", default=LOSS_FILE, help="where to save the loss curve")
    add_cache_args(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mesh = mesh_arg("2x4")
    ensure_host_devices(mesh[0] * mesh[1])
    import jax
    from tqdm import tqdm

    from pjit_pipe.cli.train import StepRecord, train
    from pjit_pipe.models.char_corpus import sample
    from pjit_pipe.simulator import gantt

    options = argparse.Namespace(
        model="gpt-tiny",
        mesh=mesh,
        schedule="zb-h1",
        microbatches=8,
        chunks=1,
        batch=32,
        steps=args.steps,
        lr=3e-3,
        seed=0,
        fail={args.steps // 3: [FAILED_WORKER]},
        rejoin={2 * args.steps // 3: [FAILED_WORKER]},
        precompile=1,
        cache_dir=args.cache_dir,
        no_cache=args.no_cache,
    )
    devices = run_devices(mesh[0] * mesh[1])  # too few accelerators: virtual CPU devices
    print(
        f"Training the tiny GPT on {mesh[0] * mesh[1]} {devices[0].platform} devices: "
        f"data={mesh[0]} x stage={mesh[1]}, schedule {options.schedule}, "
        f"{options.microbatches} microbatches of {options.batch // (mesh[0] * 8)} sequences"
    )
    print(
        f"Worker {FAILED_WORKER[0]}:{FAILED_WORKER[1]} fails during step {args.steps // 3} "
        f"and rejoins before step {2 * args.steps // 3}."
    )
    records: list[StepRecord] = []
    workers = mesh[0] * mesh[1]
    compiled: list[Any] = []  # the failure variants compiled so far (background thread)
    bars: list[Any] = []  # the progress bar, made at the first step
    print("Compiling the training step; the failure variants follow in the background.")

    def on_step(rec: StepRecord) -> None:
        if not bars:
            bars.append(tqdm(total=args.steps, desc="demo", unit="step"))
        records.append(rec)
        bars[0].set_postfix(
            loss=f"{rec.loss:.3f}",
            tok_s=f"{rec.tokens / rec.seconds:,.0f}",
            variants=f"{len(compiled)}/{workers}",
        )
        bars[0].update()

    def on_event(line: str) -> None:  # at once: a wait for a variant is said as it starts
        (bars[0].write if bars else print)(line)

    try:
        pm, state, task = train(options, on_step, compiled.append, on_event)
    finally:
        for bar in bars:
            bar.close()
    left = workers - len(compiled)
    later = "" if not left or args.no_cache else f"; the next demo compiles the other {left}"
    print(f"{len(compiled)} of {workers} failure variants ready in the background{later}")
    path = gantt(pm.schedule, args.gantt)
    print(f"Schedule chart ({options.schedule}, unit costs) saved to {path}")
    variant = pm.with_failures([FAILED_WORKER])
    path = gantt(variant.schedule, args.rerouted)
    print(f"Re-routed schedule with {FAILED_WORKER[0]}:{FAILED_WORKER[1]} down saved to {path}")
    marks = {r.step: ("failure" if r.failed else "rejoin") for r in records if r.events}
    path = loss_curve([r.loss for r in records], marks, args.loss_plot)
    print(f"Loss curve saved to {path}")
    prompt = "The sea was "
    tokens = sample(
        pm.apply,
        jax.device_get(state.params),  # the tiny model on the host, for one-device sampling
        task.corpus.encode(prompt),
        200,
        task.model.config.seq_len,
        jax.random.key(1),
    )
    print("Sample:\n" + task.corpus.decode(tokens))
    return 0
