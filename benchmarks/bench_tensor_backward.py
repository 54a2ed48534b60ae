"""The split backward with weights split over 'tensor': W from stored operands against W re-running the pullback.

A zb-h1 pipeline on a (data, stage, tensor) mesh, its table packed by the
frontend, compiled twice with the same options but one: "pullback" lowers
with `split_backward=False`, so W re-runs the stage's pullback from the
stored vjp residuals (B does too, for the input gradient alone); "stored"
is the default, where F keeps W's data operands, B stores the site
cotangents and W contracts them (docs/split_backward.md). Both programs run
one `value_and_grad` per call, in alternating order over `--rounds` rounds
after a warm-up; the figure is the median over rounds of stored / pullback
of the same round, by wall time and by this process's CPU time (steadier on
shared cores), with quartiles in brackets.

It also prints, per program, the sites of each split stage (the equations
W contracts or takes the vjp of), the residual pools' bytes per device, and
the largest difference between the two programs' losses and gradients.

The bundled Llama puts its layers in an `nn.scan` stack: the scan is one site
of the split backward, whose W takes that equation's vjp (re-running the loop
body), so only the final norm and the head are contracted from stored
operands. `--model gpt` runs the tiny GPT with Megatron annotations, whose
blocks are unrolled: every weight matmul is its own site.

Run: python -m benchmarks.bench_tensor_backward [--model llama|gpt] [--mesh 2x2x2]
    [--microbatches 4] [--batch 16] [--rounds 21]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

import pjit_pipe as pp
from benchmarks.common import quartiles, round_times
from pjit_pipe.compiler import build_program
from pjit_pipe.frontend.cutter.tensor_split import unbox
from pjit_pipe.lowering import LoweringOptions
from pjit_pipe.models import GPT, GPTConfig, Llama, LlamaConfig, lm_loss


def describe(step) -> str:
    """The split stages' sites (the primitives W transposes or takes the vjp of) and
    the residual pools' bytes per device (slots x row)."""
    low = step._low
    st = low.st
    sites = {
        s: ", ".join(sb.eqns[site.index].eqn.primitive.name for site in sb.sites)
        for s, sb in st.splitters.items()
    }
    pools = []
    for name, spec, slots in (
        ("B", st.b_spec, low.plan.bres_slots),
        ("W", st.w_spec, low.plan.res_slots),
    ):
        row = spec.total_bytes()
        pools.append(f"{name}-pool {slots} x {row / 1024:.0f} KiB")
    where = "; ".join(f"stage {s} sites: {v}" for s, v in sites.items()) or "no stage split"
    return f"{where}; {', '.join(pools)}"


def programs(model_name: str, shape: tuple[int, int, int], m: int, batch: int):
    """(the two compiled programs by name, their stage params, x, y)."""
    if model_name == "llama":
        model = Llama(LlamaConfig.tiny(tensor_parallel=True))
    else:
        model = GPT(dataclasses.replace(GPTConfig.tiny(), megatron=True))
    c = model.config
    tokens = jax.random.randint(jax.random.key(0), (batch, c.seq_len + 1), 0, c.vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]
    plain, box = unbox(model.init(jax.random.key(1), x))
    mesh = pp.make_mesh(*shape)
    pm = pp.pipeline(model, stages=shape[1], microbatches=m, schedule="zb-h1", mesh=mesh)
    cut = pm.cut(plain, x)
    splits = pm.leaf_splits(cut, plain, box)
    stage_params = cut.split(plain)
    built = {
        name: build_program(
            pm.tick_table(),
            cut.stage_fns(),
            lm_loss,
            mesh,
            stage_params,
            x,
            y,
            LoweringOptions(splits=splits, split_backward=stored),
        )
        for name, stored in (("pullback", False), ("stored", True))
    }
    return built, stage_params, x, y


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--mesh", default="2x2x2", help="DxPxT")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.mesh.split("x"))
    built, sp, x, y = programs(args.model, shape, args.microbatches, args.batch)
    print(
        f"{args.model} tiny, mesh {args.mesh}, zb-h1, m={args.microbatches}, "
        f"batch {args.batch}, jax {jax.__version__}"
    )
    results = {}
    for name, step in built.items():
        results[name] = step.value_and_grad(sp, x, y)
        print(f"    {name:8s} {describe(step)}")
    (loss_a, grads_a), (loss_b, grads_b) = results["pullback"], results["stored"]
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True)
    )
    print(f"    |loss difference| {abs(float(loss_a) - float(loss_b)):.2e}, gradients {diff:.2e}")
    calls = {
        name: (lambda step=step: step.value_and_grad(sp, x, y)) for name, step in built.items()
    }
    for clock_name, clock in (("wall", time.perf_counter), ("CPU", time.process_time)):
        times = round_times(calls, args.rounds, clock)
        ratios = [s / p for s, p in zip(times["stored"], times["pullback"], strict=True)]
        q1, med, q3 = quartiles(ratios)
        each = "  ".join(f"{n} {quartiles(t)[1] * 1e3:.1f} ms" for n, t in times.items())
        print(
            f"    {clock_name:4s} stored / pullback {med:.3f} [{q1:.3f}, {q3:.3f}]"
            f" over {args.rounds} rounds  (medians: {each})"
        )


if __name__ == "__main__":
    main()
