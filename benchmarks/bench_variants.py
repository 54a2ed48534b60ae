"""Failure variants of a 2x4 mesh: precompile time, switch time, the on-disk cache.

The tiny GPT with zb-h1, m=8, on 8 virtual CPU devices.

1. Precompile: the fault-free step and every single-failure variant, compiled
   one after another (re-routed schedule search + trace + XLA compile).
2. Switch: for each variant, the time from "these workers are down" to the
   new program's first step being dispatched (variant lookup + moving the
   stage-sharded train state into the survivors' layout, never reading the
   failed device), and that first step's time next to the median steady step
   (a compile would show there); the state bytes copied between devices by
   the switch, and by the rejoin back to the full mesh (the rejoining device
   copies its stage's rows from a live peer).
3. Disk cache: a fresh process compiling one variant with a warm
   `cache_dir` against one with a cold cache.

Run: python -m benchmarks.bench_variants [--steps N]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax

import pjit_pipe as pp
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.char_corpus import CharCorpus
from pjit_pipe.runtime import Variants

D, P, M, BATCH = 2, 4, 8, 32


def setup():
    corpus = CharCorpus.load()
    config = GPTConfig.tiny(vocab=corpus.vocab)
    rng = np.random.default_rng(0)
    batch = corpus.batch(rng, BATCH, config.seq_len)
    pm = pp.pipeline(
        GPT(config),
        stages=P,
        microbatches=M,
        schedule="zb-h1",
        mesh=pp.make_mesh(data=D, stage=P),
        optimizer=optax.adam(1e-3),
    )
    params = pm.init(jax.random.key(0), batch[0])
    state = pm.train_step(lm_loss).init(params, batch)
    return pm, state, batch


def timed_step(variant, state, batch):
    start = time.perf_counter()
    state, loss = variant(state, batch)
    jax.block_until_ready(loss)
    return state, time.perf_counter() - start


def compile_one(cache_dir: str) -> float:
    """In this process: compile the variant with worker 0:1 down; seconds."""
    pm, state, batch = setup()
    variants = Variants(pm, lm_loss, state, batch, cache_dir=cache_dir)
    start = time.perf_counter()
    variants.get([(0, 1)])
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steady steps per variant")
    parser.add_argument("--compile-one", metavar="CACHE_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_one:
        print(json.dumps({"seconds": compile_one(args.compile_one)}))
        return

    pm, state, batch = setup()
    variants = Variants(pm, lm_loss, state, batch)
    start = time.perf_counter()
    variants.precompile(max_failures=1, background=False)
    total = time.perf_counter() - start
    compiled = variants.compiled
    per = [v.compile_seconds for v in compiled.values()]
    print(
        f"precompile {len(compiled)} programs (fault-free + {len(compiled) - 1} single "
        f"failures) of a {D}x{P} mesh: {total:.1f} s total, XLA compile "
        f"{statistics.median(per):.1f} s median per program"
    )

    base = variants.get(())
    state, _ = timed_step(base, state, batch)
    steady = []
    for _ in range(args.steps):
        state, t = timed_step(base, state, batch)
        steady.append(t)
    print(f"fault-free steady step: {statistics.median(steady) * 1e3:.1f} ms")
    print(
        f"{'down':>6} {'switch ms':>10} {'first step ms':>14} {'steady step ms':>15} "
        f"{'switch B':>9} {'rejoin B':>9}"
    )
    switches, firsts = [], []
    mesh = pm.mesh.devices
    for failed in sorted(compiled, key=sorted):
        if not failed:
            continue
        start = time.perf_counter()
        variant = variants.get(failed)
        dead = {mesh[w.replica, w.stage] for w in failed}
        state, moved = variant.step.adopt(state, batch, dead)
        jax.block_until_ready(state)
        switch = time.perf_counter() - start
        switches.append(switch)
        state, first = timed_step(variant, state, batch)
        firsts.append(switch + first)
        steady = []
        for _ in range(args.steps):
            state, t = timed_step(variant, state, batch)
            steady.append(t)
        state, rejoin = base.step.adopt(state, batch)  # back on the full mesh
        down = ",".join(f"{w.replica}:{w.stage}" for w in sorted(failed))
        print(
            f"{down:>6} {switch * 1e3:10.1f} {first * 1e3:14.1f} "
            f"{statistics.median(steady) * 1e3:15.1f} {moved:>9} {rejoin:>9}"
        )
    print(
        f"median switch: {statistics.median(switches) * 1e3:.1f} ms, switch + first step: "
        f"{statistics.median(firsts) * 1e3:.1f} ms (target < 1000 ms)"
    )

    with tempfile.TemporaryDirectory() as cache:
        runs = []
        for _ in range(2):  # cold, then warm
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_variants", "--compile-one", cache],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    print(
        f"one variant in a fresh process: {runs[0]:.1f} s with a cold disk cache, "
        f"{runs[1]:.1f} s with a warm one"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
