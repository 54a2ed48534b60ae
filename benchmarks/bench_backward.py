"""The split backward: what B, W and B+W cost against the fused BW, per stage and end to end.

1. One middle stage (GPT blocks; pre-norm residual MLP blocks), each at two
   widths: the time of B, W, B+W and BW of one microbatch, as jitted functions
   of the residuals F stored. "before": W re-runs the stage pullback (the old
   split); "after": B stores the site cotangents and W transposes only the
   parameter-reading ops (split_backward.py). Ratios are over the fused BW of
   the same run. Targets: after B+W <= 1.10x BW, after W <= 0.6x BW.
2. A 1x2 pipeline whose second stage holds all the work (the first is cut off
   by a `pp.boundary` marker), m=16: zb-h1 over 1f1b, before and after
   (target after <= 1.05).
3. The tiny GPT on 2x4, m=8: `auto` scheduled with measured costs against
   every fixed kind (step time).

Run: python benchmarks/bench_backward.py [--repeats N] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_lowering import median_times

import pjit_pipe as pp
from models.gpt import GPT, Block, GPTConfig, lm_loss
from models.mlp import ResidualBlock
from pjit_pipe.lowering.stages import StageVjp


class Blocks(nn.Module):
    """`n` blocks made by `make`: the work of one middle pipeline stage."""

    make: object
    n: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.n):
            x = self.make()(x)
        return x


def _stage_ops(stages: StageVjp, s: int, params, act, y):
    """Jitted F, B, W, BW of stage s (s in the middle of a 3-stage chain)."""
    g = jnp.ones(stages.act_avals[s + 1].shape, stages.act_avals[s + 1].dtype)
    _, res = jax.jit(lambda p, a: stages.forward_with_residuals(s, p, a, None))(params, act)
    if s in stages.split:
        b = jax.jit(lambda p, r: stages.input_grad(s, p, r, g))
        _, cots = b(params, res)
        off = stages.cot_offset(s)
        res_b = {k: v.at[off[k] : off[k] + cots[k].shape[0]].set(cots[k]) for k, v in res.items()}
        w = jax.jit(lambda p, r: stages.weight_grad(s, p, r))
        bw = jax.jit(lambda p, r: stages.fused_grad(s, p, r, g))
        return {
            "B": lambda: b(params, res),
            "W": lambda: w(params, res_b),
            "BW": lambda: bw(params, res),
        }
    pull = lambda p, r: stages.pullback(s, p, r)(g)  # noqa: E731
    b = jax.jit(lambda p, r: pull(p, r)[1])
    w = jax.jit(lambda p, r: pull(p, r)[0])
    bw = jax.jit(pull)
    return {"B": lambda: b(params, res), "W": lambda: w(params, res), "BW": lambda: bw(params, res)}


def stage_costs(name: str, module: nn.Module, x: jax.Array, repeats: int) -> dict[str, float]:
    """Median times of B, W, BW of `module` as the middle stage, before and after."""
    params = module.init(jax.random.key(0), x)
    fns = [lambda p, a: a * p, lambda p, a: module.apply(p, a), lambda p, a: a * p]
    stage_params = [jnp.ones(()), params, jnp.ones(())]
    loss = lambda out, y: jnp.mean(out**2)  # noqa: E731
    x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    fs = {}
    for tag, split in (("before", ()), ("after", (1,))):
        stages = StageVjp(fns, loss, stage_params, x_aval, x_aval, split)
        for op, f in _stage_ops(stages, 1, params, x, None).items():
            fs[f"{tag} {op}"] = f
    med = median_times(fs, repeats)
    bw = med["before BW"]
    print(f"  {name}:")
    for tag in ("before", "after"):
        b, w, fused = (med[f"{tag} {k}"] for k in ("B", "W", "BW"))
        print(
            f"    {tag:6s} B {b * 1e3:7.2f} ms  W {w * 1e3:7.2f} ms  B+W {(b + w) * 1e3:7.2f} ms"
            f"  BW {fused * 1e3:7.2f} ms   B/BW {b / bw:.2f}  W/BW {w / bw:.2f}"
            f"  (B+W)/BW {(b + w) / bw:.2f}"
        )
    return med


def per_stage(repeats: int, quick: bool) -> None:
    print("1. One middle stage, one microbatch (ratios over the fused BW before):")
    rows = 8 if quick else 16
    for d in (64, 256):
        x = jax.random.normal(jax.random.key(1), (rows, 32, d))
        stage_costs(
            f"GPT stage, 2 blocks d={d}, {rows}x32 tokens",
            Blocks(lambda d=d: Block(d, 4, 4 * d), 2),
            x,
            repeats,
        )
    for d in (256, 512):
        x = jax.random.normal(jax.random.key(1), (256, d))
        stage_costs(
            f"MLP stage, 4 blocks width {d}, 256 rows",
            Blocks(lambda d=d: ResidualBlock(4 * d), 4),
            x,
            repeats,
        )


class HeavySecond(nn.Module):
    """A light first stage (one dense), then 4 residual blocks after a boundary."""

    width: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        x = pp.boundary(x)
        for _ in range(4):
            x = ResidualBlock(4 * self.width)(x)
        return nn.Dense(8)(x)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def heavy_second_stage(repeats: int, quick: bool) -> None:
    from pjit_pipe.schedules import make_schedule

    m, mb = 16, 16 if quick else 64
    model = HeavySecond(128 if quick else 256)
    x = jax.random.normal(jax.random.key(0), (m * mb, 32))
    y = jax.random.normal(jax.random.key(1), (m * mb, 8))
    mesh = pp.make_mesh(data=1, stage=2)
    params = model.init(jax.random.key(2), x)
    pm = pp.pipeline(model, stages=2, microbatches=m, schedule="1f1b", mesh=mesh)
    cut = pm.cut(params, x)
    from pjit_pipe.lowering import lower

    fs = {}
    for kind in ("1f1b", "zb-h1"):
        for tag, split in (("before", False), ("after", True)):
            if kind == "1f1b" and not split:
                continue  # 1f1b runs BW only: the same program either way
            step = lower(
                make_schedule(kind, 2, m),
                cut.stage_fns(),
                mse,
                mesh,
                cut.split(params),
                x,
                y,
                split_backward=split,
            )
            sp = cut.split(params)
            fs[f"{kind} {tag}"] = lambda step=step, sp=sp: step.value_and_grad(sp, x, y)
    med = median_times(fs, repeats)
    base = med["1f1b after"]
    print(f"2. Heavy second stage, mesh 1x2, m={m} x {mb} rows:")
    for name, t in med.items():
        print(f"    {name:14s} {t * 1e3:8.2f} ms   over 1f1b {t / base:.2f}")


def auto_vs_fixed(repeats: int, quick: bool) -> None:
    from pjit_pipe.ir.schedule import ScheduleError
    from pjit_pipe.schedules import KINDS

    D, P, m = 2, 4, 8
    config = GPTConfig.tiny()
    model = GPT(config)
    n = D * m * 2
    x = jax.random.randint(jax.random.key(0), (n, config.seq_len), 0, config.vocab)
    y = jnp.roll(x, -1, axis=1)
    mesh = pp.make_mesh(data=D, stage=P)
    params = model.init(jax.random.key(1), x)
    fs, notes = {}, {}
    kinds = ("1f1b", "zb-h1", "auto") if quick else KINDS
    for kind in kinds:
        chunks = 2 if kind in ("interleaved-1f1b", "zb-v") else 1
        try:
            pm = pp.pipeline(
                model, stages=P, microbatches=m, schedule=kind, mesh=mesh, chunks=chunks
            )
            vg = pm.value_and_grad(lm_loss)
            jax.block_until_ready(vg(params, x, y))
        except (ScheduleError, ValueError) as e:
            print(f"    {kind:18s} skipped: {e}")
            continue
        fs[kind] = lambda vg=vg: vg(params, x, y)
        if kind == "auto":
            notes[kind] = f"  measured costs {pm.measured_costs}"
    med = median_times(fs, repeats)
    best = min(med.values())
    print(f"3. Tiny GPT, mesh {D}x{P}, m={m} x 2 sequences:")
    for kind, t in med.items():
        print(
            f"    {kind:18s} {t * 1e3:8.2f} ms   over the fastest {t / best:.2f}{notes.get(kind, '')}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer kinds")
    ap.add_argument("--part", type=int, choices=(1, 2, 3), action="append")
    args = ap.parse_args(argv)
    parts = args.part or (1, 2, 3)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    if 1 in parts:
        per_stage(args.repeats, args.quick)
    if 2 in parts:
        heavy_second_stage(args.repeats, args.quick)
    if 3 in parts:
        auto_vs_fixed(args.repeats, args.quick)


if __name__ == "__main__":
    main()
