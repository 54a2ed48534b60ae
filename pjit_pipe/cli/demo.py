"""`pjit-pipe demo` (`make demo`): train the tiny GPT on 8 CPU devices and show the result.

data=2 x stage=4 with the ZB-H1 schedule: a progress bar with loss and
tokens/s, the schedule's Gantt chart written to a file, and a text sample.
"""

from __future__ import annotations

import argparse
from typing import Any

from pjit_pipe.cli.train import ensure_host_devices, mesh_arg

GANTT_FILE = "demo_schedule.png"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo", help="train the tiny GPT on 8 CPU devices", description=__doc__
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--gantt", default=GANTT_FILE, help="where to save the schedule chart")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    mesh = mesh_arg("2x4")
    ensure_host_devices(mesh[0] * mesh[1])
    import jax
    from tqdm import tqdm

    from models.text import sample
    from pjit_pipe.cli.train import train
    from pjit_pipe.simulator.plot import gantt

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
    )
    print(
        f"Training the tiny GPT on {mesh[0] * mesh[1]} {jax.devices()[0].platform} devices: "
        f"data={mesh[0]} x stage={mesh[1]}, schedule {options.schedule}, "
        f"{options.microbatches} microbatches of {options.batch // (mesh[0] * 8)} sequences"
    )
    with tqdm(total=args.steps, desc="demo", unit="step") as bar:

        def on_step(step: int, loss: float, seconds: float, tokens: int) -> None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / seconds:,.0f}")
            bar.update()

        pm, state, task = train(options, on_step)
    path = gantt(pm.schedule, args.gantt)
    print(f"Schedule chart ({options.schedule}, unit costs) saved to {path}")
    prompt = "The sea was "
    tokens = sample(
        pm.apply,
        state.params,
        task.corpus.encode(prompt),
        200,
        task.model.config.seq_len,
        jax.random.key(1),
    )
    print("Sample:\n" + task.corpus.decode(tokens))
    return 0
