"""Step time of the lowered pipeline program.

1. One CPU device (mesh 1x1, P=1): the pipelined value_and_grad against a plain
   `lax.scan` gradient accumulation over the same microbatches (target: ratio of
   medians <= 1.3).
2. Eight virtual CPU devices (mesh 2x4): the step time of every schedule kind
   that make_schedule implements, and the compiled temp memory.

Run: python -m benchmarks.bench_lowering [--repeats N]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from benchmarks.common import median_times, scan_accumulation
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.lowering import lower
from pjit_pipe.schedules import KINDS, make_schedule

VOCAB, SEQ, CLASSES = 64, 4, 16


def mlp_stages(num_stages: int, layers: int, width: int, seed: int = 0):
    """An embedding + `layers` dense layers + a head, cut into `num_stages` stages."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), layers + 2))
    per = np.array_split(np.arange(layers), num_stages)
    fns, params = [], []
    for s, idx in enumerate(per):
        p = {"w": [jax.random.normal(next(keys), (width, width)) / np.sqrt(width) for _ in idx]}
        if s == 0:
            p["emb"] = jax.random.normal(next(keys), (VOCAB, width))
        if s == num_stages - 1:
            p["head"] = jax.random.normal(next(keys), (width, CLASSES)) / np.sqrt(width)
        params.append(p)

        def fn(p, a, first=s == 0, last=s == num_stages - 1):
            if first:
                a = p["emb"][a].mean(axis=1)
            for w in p["w"]:
                a = jax.nn.gelu(a @ w)
            return a @ p["head"] if last else a

        fns.append(fn)
    return fns, params


def xent(logits: jax.Array, y: jax.Array) -> jax.Array:
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def batch(n: int, seed: int = 1):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.randint(kx, (n, SEQ), 0, VOCAB), jax.random.randint(ky, (n,), 0, CLASSES)


def one_device(repeats: int, layers: int, width: int, mbsize: int, m: int) -> None:
    fns, params = mlp_stages(1, layers, width)
    x, y = batch(m * mbsize)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "stage"))

    def model(params, a):  # the stages in a chain: the whole model
        for f, p in zip(fns, params, strict=True):
            a = f(p, a)
        return a

    base = scan_accumulation(model, xent, m)
    fs = {"lax.scan accumulation": lambda: base(params, x, y)}
    for kind in ("gpipe", "1f1b"):
        step = lower(make_schedule(kind, 1, m), fns, xent, mesh, params, x, y)
        fs[f"{kind} pipelined"] = lambda step=step: step.value_and_grad(params, x, y)
    med = median_times(fs, repeats)
    t_base = med["lax.scan accumulation"]
    print(f"P=1 mesh 1x1, {layers} layers width {width}, m={m} x {mbsize}:")
    for name, t in med.items():
        print(f"  {name:22s} {t * 1e3:8.2f} ms   ratio {t / t_base:.2f}")


def eight_devices(repeats: int, layers: int, width: int, mbsize: int, m: int) -> None:
    D, P = 2, 4
    mesh = Mesh(np.array(jax.devices()[: D * P]).reshape(D, P), ("data", "stage"))
    x, y = batch(D * m * mbsize)
    print(f"mesh {D}x{P}, {layers} layers width {width}, m={m} x {mbsize} per replica:")
    for kind in KINDS:
        v = 2 if kind in ("interleaved-1f1b", "zb-v") else 1
        try:
            sched = make_schedule(kind, P, m, chunks=v, replicas=D)
        except ScheduleError as e:
            print(f"  {kind:18s} skipped: {e}")
            continue
        fns, params = mlp_stages(P * v, layers, width)
        step = lower(sched, fns, xent, mesh, params, x, y)
        run = lambda step=step, params=params: step.value_and_grad(params, x, y)  # noqa: E731
        t = median_times({kind: run}, repeats)[kind]
        temp = step.memory_analysis().temp_size_in_bytes
        print(f"  {kind:18s} v={v}  {t * 1e3:8.2f} ms   temp {temp / 2**20:7.2f} MiB")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    one_device(args.repeats, layers=4, width=512, mbsize=64, m=8)
    one_device(args.repeats, layers=4, width=512, mbsize=256, m=8)
    eight_devices(args.repeats, layers=8, width=256, mbsize=32, m=8)


if __name__ == "__main__":
    main()
