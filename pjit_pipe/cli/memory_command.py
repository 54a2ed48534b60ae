"""`pjit-pipe memory`: what each device would hold to train a model, before anything is allocated.

Prices a bundled model (`--model gpt-tiny|mlp|llama`, the Llama at Llama-3-8B or
-70B shapes with `--config 8b|70b`) on a D x P x T deployment with adam, from
`jax.eval_shape` shapes only (`Pipelined.memory_report`), so a 70B model on 64
devices is priced on a laptop: per pipeline position the parameters, gradients,
optax state and its update, gathered parameters, residual pools (activations),
the ops' workspace, messages and the batch, their peak total, and whether it fits
`--device-memory`. `--compiled` also compiles the train step on this machine
and adds XLA's own figures, to check the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from pjit_pipe.cli.device_choice import ensure_host_devices
from pjit_pipe.cli.schedule_command import positive_int
from pjit_pipe.cli.train_args import mesh_arg
from pjit_pipe.schedules import KINDS

MODELS = ("gpt-tiny", "mlp", "llama")
CONFIGS = ("tiny", "8b", "70b")
ZERO_LEVELS = (0, 1, 3)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS.update({"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40})


def bytes_arg(text: str) -> int:
    """Parse a byte count: an integer, or a number with a unit (80GB, 80e9, 96GiB)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected bytes such as 80000000000 or 80GB, got {text!r}"
        )
    value = float(match[1]) * _UNITS[match[2] or ""]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return int(value)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `memory` subcommand."""
    p = subparsers.add_parser(
        "memory",
        help="predict each device's memory for a model, mesh, ZeRO level and schedule",
        description=__doc__.split(":", 1)[1].strip(),
    )
    p.add_argument("--model", choices=MODELS, default="gpt-tiny", help="default gpt-tiny")
    p.add_argument(
        "--config",
        choices=CONFIGS,
        default="tiny",
        help="the Llama's shapes: tiny (default), 8b or 70b (Llama-3's, bfloat16 compute)",
    )
    p.add_argument(
        "--mesh",
        type=mesh_arg,
        default=(1, 4, 1),
        metavar="DxP[xT]",
        help="data replicas x pipeline stages [x tensor] (default 1x4); need not exist here",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=ZERO_LEVELS,
        default=0,
        help="0: optax state whole; 1: optax state sharded over data; 3: parameters too",
    )
    p.add_argument(
        "--grad-sum",
        choices=("accumulator", "slices", "slices-compute"),
        default="accumulator",
        help="with --zero 1|3: sum the microbatches' gradients in one accumulator "
        "(default), reduce-scatter each into slices, or do so in the compute dtype "
        "(slices-compute)",
    )
    p.add_argument("--schedule", choices=KINDS, default="1f1b", metavar="KIND", help="default 1f1b")
    p.add_argument(
        "--balance",
        choices=("flops", "params", "flops+params"),
        default="flops",
        help="what the cutter evens over the stages (default flops; flops+params pads "
        "every device less, docs/memory.md)",
    )
    p.add_argument(
        "--microbatches", "-m", type=positive_int, metavar="M", help="per replica; default 2P"
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        metavar="B",
        help="global batch (sequences or rows); default data*microbatches",
    )
    p.add_argument("--seq", type=positive_int, metavar="S", help="sequence length (LMs)")
    p.add_argument(
        "--device-memory", type=bytes_arg, metavar="BYTES", help="what one device has (80GB)"
    )
    p.add_argument("--remat", action="store_true", help="recompute each stage's forward")
    p.add_argument(
        "--compiled",
        action="store_true",
        help="also compile the train step here and add XLA's memory analysis",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _model(args: argparse.Namespace):
    """(module, loss, x and y shapes) of the chosen model."""
    import jax
    import jax.numpy as jnp

    from pjit_pipe.cli import UsageError
    from pjit_pipe.models import GPT, GPTConfig, ResidualMLP, lm_loss, mse_loss
    from pjit_pipe.models.llama import Llama, LlamaConfig

    if args.config != "tiny" and args.model != "llama":
        raise UsageError(f"--config {args.config}: only --model llama has named configs")
    data, stages, _ = args.mesh
    m = args.microbatches or 2 * stages
    batch = args.batch or data * m
    if args.model == "mlp":
        if args.seq:
            raise UsageError("--seq: --model mlp takes rows, not sequences; drop --seq")
        x = jax.ShapeDtypeStruct((batch, 16), jnp.float32)
        y = jax.ShapeDtypeStruct((batch, 8), jnp.float32)
        return ResidualMLP(), mse_loss, x, y
    if args.model == "gpt-tiny":
        config = GPTConfig.tiny()
        # With T > 1 its blocks split as Megatron's columns and rows (as in train).
        config = dataclasses.replace(
            config, seq_len=args.seq or config.seq_len, megatron=args.mesh[2] > 1
        )
        model, seq = GPT(config), config.seq_len
    else:
        named = {
            "tiny": LlamaConfig.tiny,
            "8b": LlamaConfig.llama3_8b,
            "70b": LlamaConfig.llama3_70b,
        }
        config = named[args.config](**({"seq_len": args.seq} if args.seq else {}))
        model, seq = Llama(config), config.seq_len
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return model, lm_loss, tokens, tokens


def run(args: argparse.Namespace) -> int:
    data, stages, tensor = args.mesh
    # A prediction needs only the P stages' devices (virtual CPUs will do); --compiled
    # compiles on the whole mesh.
    need = data * stages * tensor if args.compiled else stages
    ensure_host_devices(max(need, 8))
    import jax
    import optax

    import pjit_pipe as pp
    from pjit_pipe.cli.device_choice import run_devices

    model, loss, x, y = _model(args)
    devices = run_devices(need)
    mesh_shape = (data, stages, tensor) if args.compiled else (1, stages, 1)
    mesh = pp.make_mesh(*mesh_shape, devices=devices)
    pm = pp.pipeline(
        model,
        stages=stages,
        microbatches=args.microbatches or 2 * stages,
        schedule=args.schedule,
        balance=args.balance,
        mesh=mesh,
        optimizer=optax.adam(1e-3),
        remat=args.remat,
        zero=args.zero if args.compiled else 0,
        grad_sum=args.grad_sum if args.compiled and args.zero else "accumulator",
    )
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    report = pm.memory_report(
        shapes,
        (x, y),
        loss,
        data=data,
        tensor=tensor,
        zero=args.zero,
        grad_sum=args.grad_sum,
        compiled=args.compiled,
    )
    out = report.as_dict(args.device_memory)
    out.update(model=args.model, config=args.config, schedule=args.schedule)
    if args.json:
        print(json.dumps(out))
        return 0
    print(_table(out))
    return 0


def _table(out: dict) -> str:
    """The report as text: one row per pipeline position, in GB or MB."""
    parts = ("params", "grads", "optimizer", "update", "gathered", "activations", "workspace")
    parts += ("messages", "total")
    unit, scale = ("GB", 1e9) if out["total"] >= 1e9 else ("MB", 1e6)
    D, P, T = out["mesh"]
    lines = [
        f"{out['model']} ({out['config']}) on {D}x{P}x{T}, zero {out['zero']}, {unit} per device"
    ]
    lines.append(f"{'stage':>5} " + " ".join(f"{p:>11}" for p in parts))
    for d in out["devices"]:
        lines.append(f"{d['stage']:>5} " + " ".join(f"{d[p] / scale:>11.3f}" for p in parts))
    if "fits" in out:
        verdict = "fits" if out["fits"] else "does not fit"
        lines.append(
            f"largest total {out['total'] / scale:.3f} {unit}: {verdict} in "
            f"{out['device_memory'] / scale:.3f} {unit}"
        )
    if "compiled_peak" in out:
        lines.append(
            f"compiled: arguments {out['compiled_arguments'] / scale:.3f} {unit}, temporaries "
            f"{out['compiled_temporaries'] / scale:.3f} {unit}, peak "
            f"{out['compiled_peak'] / scale:.3f} {unit}"
        )
    return "\n".join(lines)
