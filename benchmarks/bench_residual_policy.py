"""Residual policies: what a stage's split F+B+W and F+BW cost under each, over one fused vjp.

One middle pipeline stage of GPT-2 blocks (`pjit_pipe.models.gpt2.GPT2Block`,
d256 by default) between two trivial stages. For every residual policy of
`lowering.POLICIES` the stage's ops are compiled as the lowering runs them
(`stage_programs.stage_programs`: F, B, W of a split stage; F, BW of one that is not
split) and timed against one jitted `jax.vjp` program of the same stage
(forward and backward fused, XLA free to keep or recompute what it likes).
Printed per policy: split F+B+W over the fused vjp, F+BW over it, the bytes
one microbatch stores (both residual pools), whether that fits the memory
limit of `remat="auto"` (the default policy's pool rows), and the policy
`remat="auto"` would choose from these times (`residual_choice.choose_policy`).
Ratios are medians (and quartiles) over `--rounds` rounds of per-round
ratios, the programs run round robin; the choice uses the median times.

On one H200 the same comparison (bench_gpu part 4) gave 1.17-1.26x under
`dots_saveable` and 1.23-1.40x with every residual kept; run this there with
`--d 768` or `--d 2048` to see the per-policy figures on a GPU.

Run: python -m benchmarks.bench_residual_policy [--d 256] [--blocks 2] [--rounds 20]
         [--dtype f32|bf16]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import quartiles, round_times
from pjit_pipe.frontend.planning.residual_choice import choose_policy, pool_rows, row_elements
from pjit_pipe.frontend.planning.stage_programs import stage_programs
from pjit_pipe.lowering import DEFAULT_POLICY, POLICIES, LossLayout, StageVjp, saved_names
from pjit_pipe.models.gpt2 import GPT2Block


class Blocks(nn.Module):
    """`n` GPT-2 blocks: the work of one middle pipeline stage."""

    d: int
    heads: int
    n: int

    @nn.compact
    def __call__(self, h):
        mask = jnp.ones(h.shape[:2], jnp.int32)
        for _ in range(self.n):
            h = GPT2Block(self.d, self.heads)(h, mask)
        return h


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=256, help="model width")
    ap.add_argument("--blocks", type=int, default=2, help="GPT-2 blocks in the stage")
    ap.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--dtype", choices=("f32", "bf16"), default="f32", help="parameters and activations"
    )
    args = ap.parse_args(argv)
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    blocks = Blocks(args.d, max(1, args.d // 64), args.blocks)
    x = jax.random.normal(jax.random.key(0), (args.batch, args.tokens, args.d), dtype)
    params = jax.tree.map(lambda a: a.astype(dtype), blocks.init(jax.random.key(1), x))
    fns = [lambda p, a: a * p, lambda p, a: blocks.apply(p, a), lambda p, a: a * p]
    stage_params = [jnp.ones((), dtype), params, jnp.ones((), dtype)]  # keep x's dtype
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    loss = LossLayout(lambda out, y: jnp.mean((out - y) ** 2)).vector
    device = jax.devices()[0]

    def fused(p, a, g):  # one program: forward and backward
        out, pull = jax.vjp(lambda p, a: blocks.apply(p, a), p, a)
        return out, pull(g)

    vjp = jax.jit(fused)
    g = jnp.ones(x.shape, x.dtype)
    programs = {"vjp": lambda: vjp(params, x, g)}
    # "names" is a candidate only where the stage marks names (GPT2Block marks none).
    marked = saved_names(fns[1], params, aval)
    policies = [p for p in POLICIES if p != "names" or marked]
    stored, rows = {}, {}
    for policy in policies:
        for split in ((1,), ()):
            st = StageVjp(fns, loss, stage_params, aval, aval, split, (policy,) * 3)
            tag = "split" if split else "fused"
            for op, fn in stage_programs(st, 1, device, None).items():
                programs[f"{policy} {tag} {op}"] = fn
            if split:
                stored[policy] = row_elements(st, 1)
                if policy == DEFAULT_POLICY:
                    rows = pool_rows(st)
    runs = round_times(programs, args.rounds)
    times = {k: statistics.median(v) for k, v in runs.items()}
    base = times["vjp"]
    seconds = {p: sum(times[f"{p} split {op}"] for op in ("F", "B", "W")) for p in policies}
    fits = {p: all(n <= rows.get(k, 0) for k, n in stored[p].items()) for p in policies}

    def ratio(p: str, tag: str, ops: tuple[str, ...]) -> str:
        """Median and quartiles over rounds of the ops' sum over that round's vjp."""
        per_round = [
            sum(runs[f"{p} {tag} {op}"][r] for op in ops) / runs["vjp"][r]
            for r in range(args.rounds)
        ]
        low, mid, high = quartiles(per_round)
        return f"{mid:.3f} ({low:.2f}-{high:.2f})"

    print(
        f"one stage of {args.blocks} GPT-2 blocks, d{args.d} {args.dtype}, "
        f"{args.batch}x{args.tokens} tokens "
        f"per microbatch, on {device.platform}; fused vjp {1e3 * base:.3f} ms; per-round "
        "ratios over the fused vjp: median (quartiles)"
    )
    print(f"{'policy':14s} {'F+B+W / vjp':>19s} {'F+BW / vjp':>19s} {'MB stored':>10s}  fits")
    for p in policies:
        nbytes = sum(n * np.dtype(k).itemsize for (_, k), n in stored[p].items())
        print(
            f"{p:14s} {ratio(p, 'split', ('F', 'B', 'W')):>19s}"
            f" {ratio(p, 'fused', ('F', 'BW')):>19s} {nbytes / 1e6:10.3f}"
            f"  {'yes' if fits[p] else 'no (over the default rows)'}"
        )
    print(f'remat="auto" would choose: {choose_policy(seconds, fits)}')


if __name__ == "__main__":
    main()
