"""Compile time: the pipelined step and its failure variants against a plain step.

The tiny GPT of the demo (2x4 mesh, zb-h1, m=8, global batch 32) on 8 virtual
CPU devices. The reference is the plain step: `jax.value_and_grad` of the
unpipelined model's loss on the whole batch plus an adamw update, jitted on one
device. Each program is split with `jax.stages` into
- build: the pipeline's own work before JAX (schedule, re-routing, stage cut,
  tick table) - zero for the plain step;
- trace: Python to jaxpr (`jit(f).trace`);
- lower: jaxpr to StableHLO (`.lower()`);
- compile: XLA (`.compile()`);
and its ops are counted: StableHLO ops after lowering, HLO instructions after
XLA's passes. Ratios are to the plain step measured in the same round (fresh
functions each round, so nothing is reused from an earlier round; the variant
is that round's pipeline with a worker down, and shares its traced stages as
every failure variant does), medians over the rounds; `--kinds` adds the step
under other schedule kinds (1f1b and gpipe run one fused backward per stage,
where zb-h1 splits it into B and W). Then all single-failure variants through
`Variants.precompile` (two compile threads), and `pjit-pipe demo` twice in
fresh processes over one empty cache folder: cold, then warm (the second run,
which loads what the first compiled and compiles the failure variants the
first had not finished).

Run: python -m benchmarks.bench_compile [--rounds N] [--no-demo] [--kinds 1f1b,gpipe]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
import optax

import pjit_pipe as pp
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.char_corpus import CharCorpus
from pjit_pipe.runtime import Variants

# Every round compiles afresh: a persistent cache (JAX_COMPILATION_CACHE_DIR in the
# environment) would serve the later rounds' programs, which equal the first's.
jax.config.update("jax_enable_compilation_cache", False)

D, P, M, BATCH, LR = 2, 4, 8, 32, 3e-3
FAILED = (1, 2)  # the demo's failure
PHASES = ("build", "trace", "lower", "compile")


def stablehlo_ops(text: str) -> int:
    """Operations in a StableHLO module's text (one `dialect.op` per op)."""
    return len(re.findall(r"\b(?:stablehlo|sdy|mhlo|func|call)\.\w+|\bcall @", text))


def hlo_instructions(text: str) -> int:
    """Instructions in an optimized HLO module's text (`name = type op(...)` lines)."""
    return sum(1 for line in text.splitlines() if re.match(r"\s*(ROOT )?%?[\w.\-]+ = ", line))


def phases(jitted: Any, args: tuple, build: float = 0.0) -> dict[str, float]:
    """Seconds of each phase for `jitted(*args)`, and the op counts."""
    start = time.perf_counter()
    traced = jitted.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    return {
        "build": build,
        "trace": traced_at - start,
        "lower": lowered_at - traced_at,
        "compile": done - lowered_at,
        "total": build + done - start,
        "stablehlo": stablehlo_ops(lowered.as_text()),
        "hlo": hlo_instructions(compiled.as_text()),
    }


def setup() -> tuple[GPT, tuple[np.ndarray, np.ndarray]]:
    corpus = CharCorpus.load()
    config = GPTConfig.tiny(vocab=corpus.vocab)
    batch = corpus.batch(np.random.default_rng(0), BATCH, config.seq_len)
    return GPT(config), batch


def plain_jitted(model: GPT, batch: tuple) -> tuple[Any, tuple]:
    """The unpipelined value_and_grad + adamw step, jitted afresh (so nothing is
    reused), and the abstract arguments it is traced with."""
    optimizer = optax.adamw(LR)

    def step(params, opt, x, y):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(model.apply(p, x), y))(params)
        updates, opt = optimizer.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    params = jax.eval_shape(model.init, jax.random.key(0), batch[0])
    opt = jax.eval_shape(optimizer.init, params)
    return jax.jit(step), (params, opt, *batch)


def plain_step(model: GPT, batch: tuple) -> dict[str, float]:
    """The unpipelined step's phases."""
    return phases(*plain_jitted(model, batch))


def pipeline(model: GPT, kind: str = "zb-h1") -> pp.Pipelined:
    return pp.pipeline(
        model,
        stages=P,
        microbatches=M,
        schedule=kind,
        mesh=pp.make_mesh(data=D, stage=P),
        optimizer=optax.adam(LR),
    )


def pipelined_step(pm: pp.Pipelined, state: Any, batch: tuple) -> dict[str, float]:
    """The train step's phases (TrainStep.compile's program, split)."""
    step = pm.train_step(lm_loss, donate=False)
    start = time.perf_counter()
    program, _ = step._state_program(state, batch)  # schedule, cut, tick table
    build = time.perf_counter() - start
    sharding = jax.sharding.NamedSharding(pm.device_mesh, jax.sharding.PartitionSpec())
    x, y = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in batch)
    jitted = program._device_steps[(False, step._skips(program))].jitted
    return phases(jitted, (*program.layout.avals(), x, y), build)


def table(rows: dict[str, list[dict[str, float]]], plain: list[dict[str, float]]) -> None:
    print(
        f"{'program':<22}"
        + "".join(f"{p + ' s':>10}" for p in PHASES)
        + f"{'total s':>10}{'x plain':>9}{'StableHLO':>11}{'HLO':>8}"
    )
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ratio = statistics.median(r["total"] / p["total"] for r, p in zip(runs, plain, strict=True))
        print(
            f"{name:<22}"
            + "".join(f"{med[p]:10.2f}" for p in PHASES)
            + f"{med['total']:10.2f}{ratio:9.2f}{med['stablehlo']:11.0f}{med['hlo']:8.0f}"
        )


def demo_seconds(cache: str) -> float:
    """Wall seconds of `pjit-pipe demo` in a fresh process over `cache`."""
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pjit_pipe", "demo", "--cache-dir", cache],
            cwd=out,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
            capture_output=True,
            check=True,
        )
        return time.perf_counter() - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the step timings")
    parser.add_argument("--no-demo", action="store_true", help="skip the cold and warm demo")
    parser.add_argument(
        "--kinds",
        default="",
        help="schedule kinds whose step to compile beside zb-h1's, comma-separated "
        "(e.g. 1f1b,gpipe: their stages run one fused backward, where zb-h1 splits it)",
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]

    model, batch = setup()
    pm = pipeline(model)
    params = jax.jit(pm.init)(jax.random.key(0), batch[0])
    state = pm.train_step(lm_loss, donate=False).init(params, batch)
    plain: list[dict[str, float]] = []
    rows: dict[str, list[dict[str, float]]] = {"plain step": plain, "pipelined step": []}
    rows[f"variant {FAILED[0]}:{FAILED[1]} down"] = []
    rows.update({f"step under {kind}": [] for kind in kinds})
    for _ in range(args.rounds):
        plain.append(plain_step(model, batch))
        fresh = pipeline(model)  # new closures: no trace reused from an earlier round
        rows["pipelined step"].append(pipelined_step(fresh, state, batch))
        variant = fresh.with_failures([FAILED])
        rows[f"variant {FAILED[0]}:{FAILED[1]} down"].append(pipelined_step(variant, state, batch))
        for kind in kinds:
            rows[f"step under {kind}"].append(pipelined_step(pipeline(model, kind), state, batch))
    print(f"tiny GPT, {D}x{P} mesh, zb-h1, m={M}, batch {BATCH}; medians of {args.rounds} rounds")
    table(rows, plain)

    variants = Variants(pipeline(model), lm_loss, state, batch)
    variants.get(())
    start = time.perf_counter()
    variants.precompile(max_failures=1, background=False)
    total = time.perf_counter() - start
    count = len(variants.compiled) - 1
    base = statistics.median(p["total"] for p in plain)
    print(
        f"all {count} single-failure variants (build + compile, 2 threads): {total:.1f} s, "
        f"{total / base:.1f}x the plain step"
    )
    if args.no_demo:
        return
    with tempfile.TemporaryDirectory() as cache:
        cold = demo_seconds(cache)
        warm = demo_seconds(cache)
    print(
        f"pjit-pipe demo in a fresh process: {cold:.1f} s cold (empty cache), "
        f"{warm:.1f} s warm, the second run ({cold / base:.1f}x and {warm / base:.1f}x the "
        "plain step)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
