"""Training-state memory per device, and the step time, before and after stage sharding.

For each configuration, adam, two warm-up steps, then the median of --steps:

- after: `pm.train_step` (the device layout: each device holds only the
  parameter and optax rows of its stages, donated to each step);
- before: the replicated module-layout state the pipeline kept until now
  (the whole model and optax state on every device, split by stage and
  packed inside every step, merged back after it), rebuilt here from the same
  compiled pipeline's per-stage entry point.

Per device it prints the bytes held (measured from the arrays' shards),
the ideal share (its stages' parameters + optax state) and their ratio. The
flat layout pads each device's rows to the largest stage, so a device of a
small stage pays for the embedding or LM head of the largest one: the
configurations show how much.

Then, per ZeRO level (`--part zero`), the tiny GPT with adam at D = 2 and 4 on
P = 2 and D = 8 on P = 1: the largest device's state, the memory report's
prediction of it and of the step's peak, XLA's compiled temporaries and peak,
and the step time against ZeRO-1's.

The gradient sum alone (`--part grads`): one accumulator reduce-scattered
once against a reduce-scatter per microbatch into slices.

And the memory report's rows (`--part report`): Llama-3-70B's and -8B's shapes
on P = 8 x D = 8, one sequence of 4096 per microbatch, remat on, at ZeRO 0, 1
and 3, against an 80 GB device; and the padding of the bundled Llama with a 32k
vocabulary (LlamaConfig.gpu) at P = 4: the largest device's state over the mean
of the devices' own stages', and the largest stage's FLOPs over the mean, with
the stages cut by FLOPs and by FLOPs and parameters together.

Run: python -m benchmarks.bench_memory [--steps N] [--part layout|zero|grads|report ...]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import pjit_pipe as pp
from pjit_pipe.frontend.opt_state import merge_opt_state, split_opt_state
from pjit_pipe.lowering.layout.device_state import device_bytes
from pjit_pipe.lowering.memory_prediction import PARTS
from pjit_pipe.models import GPT, GPTConfig, lm_loss

CONFIGS = {
    "tiny GPT 2x4": (GPTConfig.tiny(vocab=65), 2, 4, 4),
    "wider GPT 1x8": (
        GPTConfig(vocab=512, seq_len=32, d_model=128, n_heads=4, n_layers=8, d_ff=512),
        1,
        8,
        8,
    ),
}


def timed(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, config: GPTConfig, D: int, P: int, M: int, steps: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab, size=(2 * D * M, config.seq_len)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    optimizer = optax.adam(1e-3)
    pm = pp.pipeline(
        GPT(config),
        stages=P,
        microbatches=M,
        mesh=pp.make_mesh(data=D, stage=P),
        optimizer=optimizer,
    )
    params = pm.init(jax.random.key(0), x)
    train = pm.train_step(lm_loss)
    state = train.init(params, batch)
    box = {"state": state}

    def after():
        box["state"], loss = train(box["state"], batch)
        return loss

    timed(after, 2)
    after_s = timed(after, steps)
    held = box["state"].device_bytes()
    layout = box["state"].view.layout

    # before: the whole module-layout state replicated on every device
    cut, program = pm.program(params, *batch, lm_loss)
    replicated = NamedSharding(pm.mesh, PartitionSpec())
    old = jax.device_put((params, optimizer.init(params)), replicated)
    x_r, y_r = jax.device_put(batch, replicated)
    old_box = {"state": old}

    def before():
        p, o = old_box["state"]
        sp, so, loss = program.train_step(cut.split(p), split_opt_state(cut, o, p), x_r, y_r)
        p = cut.merge(sp)
        old_box["state"] = (p, merge_opt_state(cut, so, o, p))
        return loss

    timed(before, 2)
    before_s = timed(before, steps)
    old_held = device_bytes(old_box["state"])

    print(f"{name}: step {before_s * 1e3:.1f} ms before, {after_s * 1e3:.1f} ms after")
    print(
        f"{'device':>7} {'stages':>7} {'before B':>10} {'after B':>10} {'ideal B':>10} {'ratio':>6}"
    )
    worst = 0.0
    for d, p in zip(layout.devices, layout.positions, strict=True):
        ideal = layout.ideal_bytes(p)
        worst = max(worst, held[d] / ideal)
        stages = ",".join(map(str, layout.held[p]))
        print(
            f"{d.id:>7} {stages:>7} {old_held[d]:>10} {held[d]:>10} {ideal:>10} "
            f"{held[d] / ideal:6.3f}"
        )
    print(
        f"largest after/ideal: {worst:.3f}; before/ideal up to {max(old_held.values()) / min(layout.ideal_bytes(p) for p in layout.positions):.2f}"
    )


# (zero, grad_sum) of the tables' rows; the report's also sum a bf16 model's slices
# in bf16 (on the float32 tiny GPT "slices-compute" is "slices").
LEVELS = ((0, "accumulator"), (1, "accumulator"), (1, "slices"), (3, "accumulator"), (3, "slices"))
REPORT_LEVELS = (*LEVELS, (1, "slices-compute"), (3, "slices-compute"))


def zero_table(steps: int) -> None:
    """Per ZeRO level and gradient sum: measured and predicted state, predicted and
    compiled peak, step time against ZeRO-1's with one accumulator."""
    config = GPTConfig.tiny(vocab=65)
    print(
        f"{'mesh':>5} {'zero':>4} {'grad_sum':>11} {'state B':>10} {'predicted':>10} {'temps B':>10} "
        f"{'peak B':>10} {'predicted':>10} {'ratio':>6} {'step ms':>8} {'vs zero1':>8}"
    )
    for D, P in ((2, 2), (4, 2), (8, 1)):
        M = 4
        rng = np.random.default_rng(0)
        x = rng.integers(0, config.vocab, size=(2 * D * M, config.seq_len)).astype(np.int32)
        batch = (x, np.roll(x, -1, axis=1))
        times = {}
        for zero, how in sorted(LEVELS, key=lambda z: z != (1, "accumulator")):  # it first
            pm = pp.pipeline(
                GPT(config),
                stages=P,
                microbatches=M,
                mesh=pp.make_mesh(data=D, stage=P),
                optimizer=optax.adam(1e-3),
                zero=zero,
                grad_sum=how,
            )
            shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
            report = pm.memory_report(shapes, batch, lm_loss, compiled=True)
            train = pm.train_step(lm_loss)
            box = {"state": train.init(pm.init(jax.random.key(0), x), batch)}

            def step(train=train, box=box, batch=batch):
                box["state"], loss = train(box["state"], batch)
                return loss

            timed(step, 2)
            times[zero, how] = timed(step, steps)
            held = max(box["state"].device_bytes().values())
            largest, peak = report.largest(), report.compiled["compiled_peak"]
            print(
                f"{D}x{P:<3} {zero:>4} {how:>11} {held:>10} {largest.state:>10} "
                f"{report.compiled['compiled_temporaries']:>10} {peak:>10} "
                f"{largest.total:>10} {largest.total / peak:6.3f} {times[zero, how] * 1e3:8.1f} "
                + f"{times[zero, how] / times[1, 'accumulator']:8.3f}"
            )


def grad_sum_table(steps: int) -> None:
    """The microbatches' gradient sum under ZeRO, alone: one float32 accumulator of
    the whole stage, reduce-scattered over 'data' once (what zero=1 and 3 run), against
    a reduce-scatter of each microbatch's gradient into a float32 slice (1/D of the
    accumulator, m reduce-scatters). A scan over m microbatches of a d x d weight's
    gradient, D = 4: XLA's temporaries and the step time."""
    import jax.numpy as jnp
    from jax import lax

    D, m, b = 4, 8, 64
    mesh = jax.make_mesh((D,), ("data",), devices=jax.devices()[:D])
    print(f"{'d':>5} {'per-microbatch':>15} {'temps B':>11} {'step ms':>8} {'vs once':>8}")
    for d in (256, 1024):
        xs = jax.device_put(
            np.random.default_rng(0).normal(size=(D * m, b, d)).astype(np.float32),
            NamedSharding(mesh, PartitionSpec("data")),
        )
        w = jnp.ones((d, d), jnp.float32)

        def run(xs, w, each):
            def tick(acc, x):
                g = x.T @ jnp.tanh(x @ w)  # a weight gradient's shape and cost
                if each:
                    g = lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True)
                return acc + g, None

            n = w.shape[0]
            acc = jnp.zeros((n // D if each else n, n), jnp.float32)
            acc, _ = lax.scan(tick, acc, xs)
            return acc if each else lax.psum_scatter(acc, "data", scatter_dimension=0, tiled=True)

        times, temps = {}, {}
        for each in (False, True):
            f = jax.jit(
                jax.shard_map(
                    lambda xs, w, each=each: run(xs, w, each),
                    mesh=mesh,
                    in_specs=(PartitionSpec("data"), PartitionSpec()),
                    out_specs=PartitionSpec("data"),
                    check_vma=False,
                )
            )
            compiled = f.lower(xs, w).compile()
            temps[each] = compiled.memory_analysis().temp_size_in_bytes
            call = lambda f=compiled, xs=xs, w=w: f(xs, w)  # noqa: E731
            timed(call, 2)
            times[each] = timed(call, steps)
            print(
                f"{d:>5} {each!s:>15} {temps[each]:>11,} {times[each] * 1e3:8.2f} "
                f"{times[each] / times[False]:8.3f}"
            )


def block_residuals(config: Any) -> None:
    """What one block's backward recomputes (the report's per-layer workspace), and
    its attention's share: the residuals `jax.vjp` keeps of one microbatch, with
    the attention in blocks of queries (the model's) and over the whole sequence."""
    from pjit_pipe.lowering.compute.remat_regions import region_residual_bytes
    from pjit_pipe.models.llama import Attention, LlamaBlock

    x = jax.ShapeDtypeStruct((1, config.seq_len, config.d_model), config.dtype)
    whole = dataclasses.replace(config, attention_chunk=config.seq_len)
    for label, c in ((f"queries in blocks of {config.attention_chunk}", config), ("whole", whole)):
        got = {}
        for name, module in (("block", LlamaBlock(c)), ("attention", Attention(c))):
            shapes = jax.eval_shape(module.init, jax.random.key(0), x)
            cast = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, config.dtype), shapes)
            fn = jax.checkpoint(lambda p, x, module=module: module.apply(p, x))
            got[name] = region_residual_bytes(fn, cast, x)
        print(
            f"  attention {label}: one block's recomputed residuals "
            f"{got['block'] / 1e9:.2f} GB, its attention's {got['attention'] / 1e9:.2f} GB"
        )


def report_table(plot: str | None = None) -> None:
    """The memory report's rows for Llama-3 shapes, and the 32k Llama's padding;
    with `plot`, a picture of the 70B rows (remat, cut by FLOPs) part by part."""
    from pjit_pipe.models.llama import Llama, LlamaConfig

    pictured = []  # (label, the largest device's DeviceMemory) of the 70B rows

    print(
        f"{'model':<14} {'remat':>5} {'zero':>4} {'grad_sum':>14} "
        + " ".join(f"{p:>11}" for p in (*PARTS, "total"))
        + f" {'fits 80GB':>9}  (GB per device)"
    )
    for name, config in (
        ("70B 8x8", LlamaConfig.llama3_70b(seq_len=4096)),
        ("8B 8x8", LlamaConfig.llama3_8b(seq_len=4096)),
    ):
        D, P, M = 8, 8, 8
        tokens = jax.ShapeDtypeStruct((D * M, config.seq_len), np.int32)
        # the pipeline's remat (beside the model's per-block nn.remat), and the cut
        runs = [(True, "flops"), (False, "flops"), (True, "flops+params")]
        for remat, balance in runs:
            pm = pp.pipeline(
                Llama(config),
                stages=P,
                microbatches=M,
                optimizer=optax.adam(1e-3),
                remat=remat,
                balance=balance,
            )
            shapes = jax.eval_shape(pm.module.init, jax.random.key(0), tokens)
            levels = REPORT_LEVELS if balance == "flops" else REPORT_LEVELS[-1:]
            for zero, how in levels:
                report = pm.memory_report(
                    shapes, (tokens, tokens), lm_loss, data=D, zero=zero, grad_sum=how
                )
                d = report.as_dict(80 * 10**9)
                label = name if balance == "flops" else f"{name} f+p"
                if name.startswith("70B") and remat and balance == "flops":
                    pictured.append((f"zero {zero}, {how}", report.largest()))
                print(
                    f"{label:<14} {remat!s:>5} {zero:>4} {how:>14} "
                    + " ".join(f"{d[p] / 1e9:11.2f}" for p in (*PARTS, "total"))
                    + f" {d['fits']!s:>9}"
                )
        block_residuals(config)
    if plot:
        draw_report(pictured, plot)
    config = LlamaConfig.gpu()
    tokens = jax.ShapeDtypeStruct((8, config.seq_len), np.int32)
    for balance in ("flops", "flops+params"):
        pm = pp.pipeline(
            Llama(config), stages=4, microbatches=8, optimizer=optax.adam(1e-3), balance=balance
        )
        shapes = jax.eval_shape(pm.module.init, jax.random.key(0), tokens)
        report = pm.memory_report(shapes, (tokens, tokens), lm_loss)
        own = [d.own_state for d in report.devices]
        largest, flops = report.largest().state, pm.cut(shapes, tokens).flops
        print(
            f"Llama vocab {config.vocab} at P=4, balance={balance}: each device holds "
            f"{largest:,} B; own stages "
            + ", ".join(f"{b:,}" for b in own)
            + f"; largest / mean own {largest / (sum(own) / len(own)):.3f}; largest / mean "
            f"stage FLOPs {max(flops) / (sum(flops) / len(flops)):.3f}"
        )


def draw_report(rows: list[tuple[str, Any]], path: str) -> None:
    """Stacked bars of each row's peak, part by part: the state, the gradient and
    inputs, then the larger of the tick loop's parts and the update's (DeviceMemory
    .total), against an 80 GB device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(
        zip(
            ("params", "optimizer", "grads", "gathered", "workspace", "activations", "update"),
            plt.get_cmap("tab10").colors,
            strict=False,
        )
    )
    fig, ax = plt.subplots(figsize=(8.5, 0.45 * len(rows) + 1.4))
    for y, (_, d) in enumerate(rows):
        loop = {"activations": d.activations, "workspace": d.workspace}
        loop["other"] = d.messages
        after = {"update": d.update}
        (loop if d.gathered_in_loop else after)["gathered"] = d.gathered
        peak = loop if sum(loop.values()) >= sum(after.values()) else after
        parts = {"params": d.params, "optimizer": d.optimizer, "grads": d.grads}
        parts["other"] = d.inputs
        for name, b in peak.items():
            parts[name] = parts.get(name, 0) + b
        left = 0.0
        for name, b in parts.items():
            ax.barh(y, b / 1e9, left=left, color=colors.get(name, "0.75"), edgecolor="white")
            left += b / 1e9
        ax.text(left + 1, y, f"{left:.1f}", va="center", fontsize=8)
    ax.axvline(80, color="black", lw=1, ls="--")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("GB per device at the step's peak (80 GB dashed)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*colors.values(), "0.75")]
    ax.legend(handles, [*colors, "messages, inputs"], fontsize=7, loc="lower right")
    ax.set_title("Llama-3-70B, 8x8, 4096 tokens, m = 8, remat, adam: memory report")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--plot", default=None, help="the 70B report rows as a picture (.png)")
    parser.add_argument(
        "--part",
        action="append",
        choices=("layout", "zero", "grads", "report"),
        help="which tables (default all)",
    )
    args = parser.parse_args(argv)
    parts = args.part or ["layout", "zero", "grads", "report"]
    if "layout" in parts:
        for name, (config, D, P, M) in CONFIGS.items():
            measure(name, config, D, P, M, args.steps)
    if "zero" in parts:
        zero_table(args.steps)
    if "grads" in parts:
        grad_sum_table(args.steps)
    if "report" in parts:
        report_table(args.plot)


if __name__ == "__main__":
    main(sys.argv[1:])
