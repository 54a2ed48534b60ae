"""The split backward on a model that draws random numbers (dropout).

A stage function reads its microbatch's keys from a context variable, so the
split backward traces them as explicit inputs of the stage jaxpr
(`pjit_pipe/lowering/compute/stage_backward.py`). Before, a model lowered with
`rngs=` fell back to a W that re-ran the stage's pullback (B + W about twice
BW). On a 1x2 pipeline of pre-norm MLP blocks with dropout, this times 1f1b,
zb-h1 with the old W (`lower(..., split_backward=False)`) and zb-h1 with the
split, in alternating rounds in one process, and prints the medians, each
over 1f1b's time of the same round, and the losses (the same keys: equal).

Run: python -m benchmarks.bench_dropout [--rounds N] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import statistics

import flax.linen as nn
import jax

import pjit_pipe as pp
from benchmarks.common import mse, round_times
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.schedules import make_schedule


class DropoutBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        h = nn.Dropout(0.1, deterministic=False)(nn.gelu(h))
        return x + nn.Dense(self.width)(h)


class DropoutMLP(nn.Module):
    """Two blocks on each of two stages (a `pp.boundary` between them)."""

    width: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for i in range(4):
            if i == 2:
                x = pp.boundary(x)
            x = DropoutBlock(self.width)(x)
        return nn.Dense(8)(x)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    args = ap.parse_args(argv)
    m, rows, P = 8, 16 if args.quick else 64, 2
    model = DropoutMLP(128 if args.quick else 256)
    x = jax.random.normal(jax.random.key(0), (m * rows, 32))
    y = jax.random.normal(jax.random.key(1), (m * rows, 8))
    params = model.init({"params": jax.random.key(2), "dropout": jax.random.key(3)}, x)
    mesh = pp.make_mesh(data=1, stage=P)
    rngs = {"dropout": jax.random.key(5)}
    pm = pp.pipeline(model, stages=P, microbatches=m, schedule="zb-h1", mesh=mesh)
    cut, _ = pm.program(params, x, y, mse, rngs=rngs)
    sp = cut.split(params)
    programs = {}
    for name, kind, split in (
        ("1f1b", "1f1b", True),
        ("zb-h1, W re-runs the pullback", "zb-h1", False),
        ("zb-h1, split backward", "zb-h1", True),
    ):
        step = lower(make_schedule(kind, P, m), cut.stage_fns(), mse, mesh, sp, x, y, LoweringOptions(rngs=rngs, split_backward=split))  # fmt: skip
        programs[name] = lambda step=step: step.value_and_grad(sp, x, y, rngs)
    losses = {name: float(f()[0]) for name, f in programs.items()}
    times = round_times(programs, args.rounds)
    print(f"device: {jax.devices()[0].platform}")
    print(f"dropout MLP, mesh 1x{P}, m={m} x {rows} rows, {args.rounds} rounds:")
    for name, t in times.items():
        over = statistics.median(a / b for a, b in zip(t, times["1f1b"], strict=True))
        print(
            f"  {name:30s} {statistics.median(t) * 1e3:8.2f} ms  over 1f1b {over:.3f}"
            f"  loss {losses[name]:.6f}"
        )


if __name__ == "__main__":
    main()
