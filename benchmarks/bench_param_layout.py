"""Parameters of the device and inside the tick loop: size classes against flat rows.

Stages of different parameter shapes kept in a flat row per dtype make
every op slice its weights out of it (XLA copies a slice that feeds a
matmul). Size classes are whole buffers per (dtype, size) that an op
reshapes (`pjit_pipe/lowering/layout/param_layout.py`), the device's own
layout or, where that costs too much memory, each chunk's inside the loop.
For each model and kind this compiles both (the flat one by refusing every
class, `MAX_CLASS_OVERHEAD = 0`) and
prints the classes' bytes over the flat row's, XLA's compiled temp memory,
the median step time of each over `--rounds` rounds of alternating calls,
and the median of the per-round ratios.

Run: python -m benchmarks.bench_param_layout [--rounds N] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pjit_pipe as pp
from benchmarks.common import HeavySecond, mse, round_times
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.lowering.layout import param_layout
from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss
from pjit_pipe.schedules import make_schedule


def _case(name, model, x, y, loss, D, P, m, kinds, rounds, failed=()):
    """With `failed` workers the schedule is re-routed and staggered, and the
    programs time `train_step` (SGD), whose optimizer steps inside the loop."""
    mesh = pp.make_mesh(data=D, stage=P)
    params = model.init(jax.random.key(2), x)
    cut = pp.pipeline(model, stages=P, microbatches=m, schedule="1f1b", mesh=mesh).cut(params, x)
    sp = cut.split(params)
    programs, notes = {}, {}
    default = param_layout.MAX_CLASS_OVERHEAD
    try:
        for kind in kinds:
            for layout, overhead in (("flat", 0.0), ("classes", default)):
                param_layout.MAX_CLASS_OVERHEAD = overhead
                sched = make_schedule(kind, P, m, replicas=D, failed=failed)
                if failed:
                    opt = optax.sgd(0.1)
                    step = lower(
                        sched, cut.stage_fns(), loss, mesh, sp, x, y, LoweringOptions(optimizer=opt)
                    )
                    state = step.init_opt_state(sp)
                    programs[(kind, layout)] = lambda step=step, state=state: step.train_step(
                        sp, state, x, y
                    )
                else:
                    step = lower(sched, cut.stage_fns(), loss, mesh, sp, x, y)
                    programs[(kind, layout)] = lambda step=step: step.value_and_grad(sp, x, y)
                temp = step.memory_analysis().temp_size_in_bytes / 2**20
                notes[(kind, layout)] = f"temp {temp:6.2f} MiB"
                if layout == "classes":
                    spec = step._low.param_spec
                    notes[(kind, "overhead")] = (
                        "the device's classes: "
                        f"{spec.total_bytes() / spec.without_classes().total_bytes():.3f}x "
                        "its flat rows"
                        if spec.classes
                        else "classes in the loop / flat row bytes per chunk: "
                        + ", ".join(
                            f"{_class_bytes(ly) / _flat_bytes(ly):.3f}" for ly in step._low.layouts
                        )
                    )
    finally:
        param_layout.MAX_CLASS_OVERHEAD = default
    times = round_times(programs, rounds)
    print(f"  {name}, mesh {D}x{P}, m={m}, {rounds} rounds:")
    for kind in kinds:
        print(f"    {kind}: {notes[(kind, 'overhead')]}")
        for layout in ("flat", "classes"):
            ms = statistics.median(times[(kind, layout)]) * 1e3
            print(f"      {layout:8s} {ms:8.2f} ms  {notes[(kind, layout)]}")
        ratios = [
            c / f for c, f in zip(times[(kind, "classes")], times[(kind, "flat")], strict=True)
        ]
        q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        print(f"      classes / flat {med:.3f} [{q1:.3f}, {q3:.3f}]")


def _flat_bytes(layout: param_layout.ChunkLayout) -> int:
    return sum(layout.spec.nbytes(k) for k in layout.spec.sizes)


def _class_bytes(layout: param_layout.ChunkLayout) -> int:
    return sum(n * np.dtype(k).itemsize for n, k in layout.sizes.values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    args = ap.parse_args(argv)
    print(f"device: {jax.devices()[0].platform}")
    m, mb = 16, 16 if args.quick else 64
    x = jax.random.normal(jax.random.key(0), (m * mb, 32))
    y = jax.random.normal(jax.random.key(1), (m * mb, 8))
    heavy = HeavySecond(128 if args.quick else 256)
    _case("heavy second stage", heavy, x, y, mse, 1, 2, m, ("1f1b", "zb-h1"), args.rounds)
    config = GPTConfig.tiny()
    tokens = jax.random.randint(jax.random.key(0), (2 * 8 * 2, config.seq_len), 0, config.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    gpt = GPT(config)
    _case("tiny GPT", gpt, tokens, targets, lm_loss, 2, 4, 8, ("1f1b", "zb-h1"), args.rounds)
    _case(
        "tiny GPT, worker 0:1 failed (re-routed, staggered; train_step)",
        *(gpt, tokens, targets, lm_loss, 2, 4, 8, ("zb-h1",), args.rounds),
        failed=[(0, 1)],
    )


if __name__ == "__main__":
    main()
