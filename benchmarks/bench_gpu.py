"""The tick body on one accelerator: what a tick costs, and each kind's step time
against a plain gradient-accumulation scan over the same microbatches.

    python benchmarks/bench_gpu.py [--modes off,default,conditional] [--rounds N] [--quick]

Runs on the default backend's first device: a GPU where there is one (on a CPU
the script runs the same, to check it; the command-buffer flags then change
nothing).

Each command-buffer mode runs in a child process (XLA reads XLA_FLAGS once):
- off: `--xla_gpu_enable_command_buffer=`: every kernel is launched from the
  host, and each executed `lax.cond` copies its predicate to the host and waits
  (XLA's ConditionalThunk);
- default: XLA's default command types;
- conditional: the default plus CONDITIONAL and WHILE, so the tick loop and its
  conds become CUDA-graph conditional nodes, decided on the device.

In each mode:
1. What a tick costs beside its ops: `tick_seconds` (the idle loop that
   `costs="measure"` times), and the real tick body: zb-h1's table with N empty
   ticks appended, timed against the table alone in the same rounds.
2. A GPT's value_and_grad on a 1x1 mesh under every kind (interleaved-1f1b and
   zb-v run two chunks on the one device) against `lax.scan` over the
   microbatches of `jax.value_and_grad`: the median of the per-round ratios, the
   ticks of each program, its first call (trace and compile), and its worst
   gradient error against the scan's.
3. Where the time goes: each stage's F, B, W and fused BW timed alone and the
   tick's fixed cost (`costs="measure"`), and each program's step against the
   lockstep price of the table it runs under those costs (`packed_time`).
With one stage there is no bubble: every kind does the scan's work, so the
ratio is what the tick-synchronous program costs over the plainest loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

MODES = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "conditional": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE",
}
CHUNKED = ("interleaved-1f1b", "zb-v")  # kinds that need two chunks per device


def run_mode(mode: str, rounds: int, quick: bool, idle: int) -> None:
    """Both parts in this process, under the XLA_FLAGS its parent set for `mode`."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(__file__))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from timing import quartiles, round_times

    import pjit_pipe as pp
    from models.gpt import GPT, GPTConfig, lm_loss
    from pjit_pipe.frontend.measure import tick_seconds
    from pjit_pipe.ir.costs import Costs
    from pjit_pipe.lowering import lower
    from pjit_pipe.passes.pack_ticks import pack_ticks
    from pjit_pipe.schedules import KINDS
    from pjit_pipe.simulator.simulate import packed_time

    device = jax.devices()[0]
    print(
        f"== mode {mode}: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__},"
        f" XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    if quick:
        config, m, rows = GPTConfig.tiny(), 4, 2
    else:
        config = GPTConfig(vocab=512, seq_len=256, d_model=512, n_heads=8, n_layers=4, d_ff=2048)
        m, rows = 8, 16
    model = GPT(config)
    x = jax.random.randint(jax.random.key(0), (m * rows, config.seq_len), 0, config.vocab)
    y = jnp.roll(x, -1, axis=1)
    params = model.init(jax.random.key(1), x)
    mesh = pp.make_mesh(data=1, stage=1)
    print(f"   GPT {config}, m={m} x {rows} sequences", flush=True)

    # 1. A tick's own cost.
    message = jax.ShapeDtypeStruct((rows, config.seq_len, config.d_model), jnp.float32)
    print(f"1. idle loop (tick_seconds): {tick_seconds(mesh, message) * 1e6:8.1f} us a tick")
    pm = pp.pipeline(model, stages=1, microbatches=m, schedule="zb-h1", mesh=mesh)
    cut = pm.cut(params, x)
    split = cut.split(params)
    table = pack_ticks(pm.schedule, Costs(), 1)
    padded = dataclasses.replace(table, ticks=table.ticks + ({},) * idle)
    steps = {
        name: lower(t.schedule, cut.stage_fns(), lm_loss, mesh, split, x, y, ticks=t)
        for name, t in (("table", table), ("padded", padded))
    }
    times = round_times(
        {k: lambda s=s: s.value_and_grad(split, x, y) for k, s in steps.items()}, rounds
    )
    extra = [(p - t) / idle for p, t in zip(times["padded"], times["table"], strict=True)]
    q1, med, q3 = quartiles(extra)
    print(
        f"   real tick body, zb-h1 ({len(table)} ticks) + {idle} empty ticks:"
        f" {med * 1e6:8.1f} us an empty tick [{q1 * 1e6:.1f}, {q3 * 1e6:.1f}]",
        flush=True,
    )

    # 2. Every kind against the scan.
    scan = scan_accumulation(lambda p, xb: model.apply(p, xb), lm_loss, m)
    ref_loss, ref_grads = jax.block_until_ready(scan(params, x, y))
    programs = {"lax.scan": lambda: scan(params, x, y)}
    notes, pipelines = {}, {}
    for kind in KINDS:
        start = time.perf_counter()
        pm = pp.pipeline(
            model,
            stages=1,
            microbatches=m,
            schedule=kind,
            mesh=mesh,
            chunks=2 if kind in CHUNKED else 1,
        )
        vg = pm.value_and_grad(lm_loss)
        loss, grads = jax.block_until_ready(vg(params, x, y))
        first = time.perf_counter() - start
        _, step = pm.program(params, x, y, lm_loss)
        error = max(
            float(jnp.max(jnp.abs(g - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))
            for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
        )
        loss_error = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
        notes[kind] = (
            f"{len(step._low.plan.updates):4d} ticks  first call {first:6.1f} s"
            f"  loss err {loss_error:.1e}  worst grad err {error:.1e} ({pm.schedule.kind})"
        )
        programs[kind] = lambda vg=vg: vg(params, x, y)
        pipelines[kind] = (pm, step)
        print(f"   compiled {kind}: {notes[kind]}", flush=True)
    times = round_times(programs, rounds)
    base = times["lax.scan"]
    print(f"2. {rounds} rounds; median ms, and the median per-round ratio over lax.scan:")
    for name, t in times.items():
        q1, med, q3 = quartiles([a / b for a, b in zip(t, base, strict=True)])
        print(
            f"   {name:17s} {quartiles(t)[1] * 1e3:8.2f} ms  {med:5.3f} [{q1:.3f}, {q3:.3f}]"
            f"  {notes.get(name, '')}"
        )

    # 3. The ops alone, and each step against its table's price.
    print(f"3. lax.scan per microbatch {quartiles(base)[1] * 1e3 / m:.3f} ms; ops alone (ms):")
    measured = {}
    for kind, (pm, step) in pipelines.items():
        chunks = pm.schedule.chunks
        if chunks not in measured:
            measured[chunks] = pm.measure_costs(params, x, y, lm_loss)
            ms = pm.stage_times  # seconds, per virtual stage
            for s in range(len(ms.f)):
                print(
                    f"   {chunks} chunk(s), stage {s}: F {ms.f[s] * 1e3:.3f}  B {ms.b[s] * 1e3:.3f}"
                    f"  W {ms.w[s] * 1e3:.3f}  BW {ms.bw[s] * 1e3:.3f}"
                    f"  F not split {ms.f_fused[s] * 1e3:.3f}"
                )
            print(f"   {chunks} chunk(s): the tick {ms.tick * 1e3:.4f}", flush=True)
        table = step._low.ticks
        if table is None:
            continue
        priced = packed_time(table, measured[chunks])
        ran = quartiles(times[kind])[1] * 1e3
        print(
            f"   {kind:17s} step {ran:8.2f} ms  priced {priced:8.2f} ms  step/priced {ran / priced:.3f}"
        )
    sys.stdout.flush()


def scan_accumulation(apply, loss_fn, m: int):
    """The baseline: jax.value_and_grad of each microbatch, summed by a lax.scan."""
    import jax
    import jax.numpy as jnp

    def loss(params, xb, yb):
        return loss_fn(apply(params, xb), yb)

    @jax.jit
    def step(params, x, y):
        xs = x.reshape(m, -1, *x.shape[1:])
        ys = y.reshape(m, -1, *y.shape[1:])
        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, jax.value_and_grad(loss)(params, *mb)), None

        (value, grads), _ = jax.lax.scan(body, zero, (xs, ys))
        return jax.tree.map(lambda a: a / m, (value, grads))

    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="off,default,conditional", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--idle", type=int, default=256, help="empty ticks appended in part 1")
    ap.add_argument("--quick", action="store_true", help="the tiny GPT (a CPU check)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mode")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # set in the child processes
    args = ap.parse_args(argv)
    if args.mode is not None:
        run_mode(args.mode, args.rounds, args.quick, args.idle)
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    for mode in modes:
        flags = f"{os.environ.get('XLA_FLAGS', '')} {MODES[mode]}".strip()
        child = [sys.executable, __file__, "--mode", mode, "--rounds", str(args.rounds)]
        child += ["--idle", str(args.idle), *(["--quick"] if args.quick else [])]
        try:
            done = subprocess.run(
                child, env={**os.environ, "XLA_FLAGS": flags}, timeout=args.timeout
            )
            if done.returncode:
                print(f"== mode {mode} failed (exit {done.returncode})", flush=True)
        except subprocess.TimeoutExpired:
            print(f"== mode {mode} stopped after {args.timeout:g} s", flush=True)


if __name__ == "__main__":
    main()
