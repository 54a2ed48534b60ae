"""`pjit-pipe train`: train an example model with a pipeline schedule and print the loss.

JAX is imported only inside `run`, after XLA_FLAGS asks for enough host (CPU)
devices for the mesh; the flag does not affect GPU or TPU devices.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

MODELS = ("gpt-tiny", "mlp")
DEVICE_FLAG = "--xla_force_host_platform_device_count"


def mesh_arg(text: str) -> tuple[int, int]:
    """Parse DxP (data replicas x pipeline stages), e.g. 2x4."""
    match = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not match or min(int(g) for g in match.groups()) < 1:
        raise argparse.ArgumentTypeError(f"expected DxP with positive integers, got {text!r}")
    return int(match[1]), int(match[2])


def ensure_host_devices(count: int) -> None:
    """Ask XLA for at least `count` CPU devices, if JAX has not been imported yet."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    found = re.search(rf"{DEVICE_FLAG}=(\d+)", flags)
    if found and int(found[1]) >= count:
        return
    flags = re.sub(rf"\s*{DEVICE_FLAG}=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_FLAG}={count}".strip()


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by `train` and `demo`."""
    from pjit_pipe.cli.schedule import positive_float, positive_int
    from pjit_pipe.schedules import KINDS

    parser.add_argument("--model", choices=MODELS, default="gpt-tiny")
    parser.add_argument("--mesh", type=mesh_arg, default=(1, 4), metavar="DxP")
    parser.add_argument("--schedule", choices=KINDS, default="1f1b", metavar="KIND")
    parser.add_argument("--microbatches", type=positive_int, default=4, metavar="M")
    parser.add_argument("--chunks", type=positive_int, default=1, metavar="V")
    parser.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default 2*D*M)"
    )
    parser.add_argument("--steps", type=positive_int, default=100, metavar="N")
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="train an example model on a pipeline", description=__doc__
    )
    add_training_args(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.set_defaults(run=run)


@dataclass
class Task:
    """An example model with its data stream and loss."""

    model: Any
    loss_fn: Any
    next_batch: Any  # () -> (x, y)
    tokens_per_example: int
    corpus: Any = None


def make_task(name: str, batch: int, seed: int) -> Task:
    import numpy as np

    from models import GPT, GPTConfig, ResidualMLP, lm_loss, mse_loss
    from models.text import CharCorpus

    rng = np.random.default_rng(seed)
    if name == "gpt-tiny":
        corpus = CharCorpus.load()
        config = GPTConfig.tiny(vocab=corpus.vocab)
        return Task(
            GPT(config),
            lm_loss,
            lambda: corpus.batch(rng, batch, config.seq_len),
            config.seq_len,
            corpus,
        )
    teacher = rng.normal(size=(16, 8)).astype(np.float32) / 4.0

    def regression():
        x = rng.normal(size=(batch, 16)).astype(np.float32)
        return x, np.sin(x @ teacher)

    return Task(ResidualMLP(), mse_loss, regression, 1)


def train(args: argparse.Namespace, on_step: Any) -> tuple[Any, Any, Task]:
    """Build the pipeline and run args.steps steps; on_step(step, loss, seconds, tokens)
    after each (tokens: input positions in the step's global batch)."""
    data, stages = args.mesh
    ensure_host_devices(data * stages)
    import jax
    import optax

    import pjit_pipe as pp

    batch = args.batch or 2 * data * args.microbatches
    task = make_task(args.model, batch, args.seed)
    pm = pp.pipeline(
        task.model,
        stages=stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=args.chunks,
        mesh=pp.make_mesh(data=data, stage=stages),
        optimizer=optax.adam(args.lr),
    )
    x, y = task.next_batch()
    params = pm.init(jax.random.key(args.seed), x)
    step_fn = pm.train_step(task.loss_fn)
    state = step_fn.init(params, (x, y))
    for step in range(args.steps):
        start = time.perf_counter()
        state, loss = step_fn(state, (x, y))
        loss = float(loss)
        on_step(step, loss, time.perf_counter() - start, batch * task.tokens_per_example)
        x, y = task.next_batch()
    return pm, state, task


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    bar = None if args.json else tqdm(total=args.steps, desc=f"train {args.model}", unit="step")

    def on_step(step: int, loss: float, seconds: float, tokens: int) -> None:
        tokens_per_s = tokens / seconds
        if bar is None:
            record = {"step": step, "loss": loss, "seconds": seconds, "tokens_per_s": tokens_per_s}
            print(json.dumps(record), flush=True)
        else:
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            bar.update()

    try:
        train(args, on_step)
    finally:
        if bar is not None:
            bar.close()
    return 0
