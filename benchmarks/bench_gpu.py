"""The tick body on accelerators: what a tick costs, and each kind's step time
against a plain gradient-accumulation scan over the same microbatches.

    python -m benchmarks.bench_gpu [--modes off,default,conditional] [--rounds N]
                                   [--stages P] [--pricing unit,measure] [--quick]

Runs on the default backend's devices: GPUs where there are some. On a
machine without one (no `nvidia-smi`) it runs the tiny GPT in the default
mode alone unless told otherwise: the command-buffer flags change nothing on
a CPU, and the GPU's model would take minutes a step there. `--stages P`
pipelines over the first P devices (mesh 1xP; the model gets at least 2P
blocks); the scan and part 4 run on the first device.

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
2. A GPT's value_and_grad on the mesh under every kind (interleaved-1f1b and
   zb-v run two chunks on each device) against `lax.scan` over the
   microbatches of `jax.value_and_grad`: the median of the per-round ratios, the
   ticks of each program (and how many loss-stage F + backward groups it runs
   as one op), its first call (trace and compile), and its worst gradient
   error against the scan's. Each kind twice: packed under unit costs (the
   default), and under measured ones (`costs="measure"`), which price the loss
   stage's F and backward as one program, so its packed table fuses them.
3. Where the time goes: each stage's F, B, W and fused BW (and the loss
   stage's F and backward as one program) timed alone and the
   tick's fixed cost (`costs="measure"`), and each program's step against the
   lockstep price of the table it runs under those costs (`packed_time`).
4. One microbatch's forward and backward as two programs against one: the
   jitted `jax.value_and_grad` of the model, and a jitted `jax.vjp` forward
   that returns its residuals and a jitted backward that reads them, with every
   residual kept and with `jax.checkpoint`'s dots_saveable (what pjit_pipe's F
   keeps: lowering/compute/stages.py); part 3 gives pjit_pipe's own F and BW.
With one stage (the default) there is no bubble: every kind does the scan's
work, so the ratio is what the tick-synchronous program costs over the
plainest loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

MODES = {
    "off": "--xla_gpu_enable_command_buffer=",
    "default": "",
    "conditional": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE",
}
CHUNKED = ("interleaved-1f1b", "zb-v")  # kinds that need two chunks per device


def run_mode(
    mode: str, rounds: int, quick: bool, idle: int, stages: int, pricing: tuple[str, ...]
) -> None:
    """Every part in this process, under the XLA_FLAGS its parent set for `mode`."""
    import jax
    import jax.numpy as jnp

    import pjit_pipe as pp
    from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss

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
    # Enough blocks for two chunks on every stage.
    config = dataclasses.replace(config, n_layers=max(config.n_layers, 2 * stages))
    model = GPT(config)
    x = jax.random.randint(jax.random.key(0), (m * rows, config.seq_len), 0, config.vocab)
    y = jnp.roll(x, -1, axis=1)
    params = model.init(jax.random.key(1), x)
    print(f"   GPT {config}, m={m} x {rows} sequences, mesh 1x{stages}", flush=True)
    run = Run(model, lm_loss, params, x, y, m, pp.make_mesh(data=1, stage=stages), rounds)
    tick_cost(run, jax.ShapeDtypeStruct((rows, config.seq_len, config.d_model), jnp.float32), idle)
    times, pipelines = kinds_against_scan(run, pricing)
    against_price(run, times, pipelines)
    split_against_fused(run, x[:rows], y[:rows])


@dataclasses.dataclass(frozen=True)
class Run:
    """What every part times: a model, its loss, a batch of m microbatches, a 1xP mesh."""

    model: Any
    loss_fn: Callable
    params: Any
    x: Any
    y: Any
    m: int
    mesh: Any
    rounds: int

    def pipeline(self, kind: str, costs: Any = None) -> Any:
        import pjit_pipe as pp

        chunks = 2 if kind in CHUNKED else 1
        return pp.pipeline(
            self.model,
            stages=self.mesh.shape["stage"],
            microbatches=self.m,
            schedule=kind,
            mesh=self.mesh,
            chunks=chunks,
            costs=costs,
        )


def tick_cost(run: Run, message: Any, idle: int) -> None:
    """Part 1: the idle loop that costs="measure" times, and an empty tick of the real
    tick body (zb-h1's table with `idle` empty ticks appended, against the table)."""
    from benchmarks.common import quartiles, round_times
    from pjit_pipe.frontend.planning.measure import tick_seconds
    from pjit_pipe.ir.costs import Costs
    from pjit_pipe.lowering import lower
    from pjit_pipe.tick_packing.packer import pack_ticks

    print(f"1. idle loop (tick_seconds): {tick_seconds(run.mesh, message) * 1e6:8.1f} us a tick")
    pm = run.pipeline("zb-h1")
    cut = pm.cut(run.params, run.x)
    split = cut.split(run.params)
    table = pack_ticks(pm.schedule, Costs(), 1)
    padded = dataclasses.replace(table, ticks=table.ticks + ({},) * idle)
    programs = {}
    for name, t in (("table", table), ("padded", padded)):
        step = lower(t, cut.stage_fns(), run.loss_fn, run.mesh, split, run.x, run.y)
        programs[name] = lambda step=step: step.value_and_grad(split, run.x, run.y)
    times = round_times(programs, run.rounds)
    extra = [(p - t) / idle for p, t in zip(times["padded"], times["table"], strict=True)]
    q1, med, q3 = quartiles(extra)
    print(
        f"   real tick body, zb-h1 ({len(table)} ticks) + {idle} empty ticks:"
        f" {med * 1e6:8.1f} us an empty tick [{q1 * 1e6:.1f}, {q3 * 1e6:.1f}]",
        flush=True,
    )


def kinds_against_scan(run: Run, pricing: tuple[str, ...]) -> tuple[dict, dict]:
    """Part 2: every kind's step against the scan, packed under unit costs (the
    default; "unit" in `pricing`) and under measured ones ("measure":
    `costs="measure"`, which prices the loss stage's F and backward as one
    program); returns (round times by program, {program: (pipeline, its
    compiled step)})."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import quartiles, round_times, scan_accumulation
    from pjit_pipe.schedules import KINDS

    params, x, y = run.params, run.x, run.y
    scan = scan_accumulation(lambda p, xb: run.model.apply(p, xb), run.loss_fn, run.m)
    ref_loss, ref_grads = jax.block_until_ready(scan(params, x, y))
    programs = {"lax.scan": lambda: scan(params, x, y)}
    notes, pipelines = {}, {}
    # An asynchronous schedule is not packed: measured costs change nothing there.
    runs = [(k, None) for k in KINDS if "unit" in pricing]
    runs += [(k, "measure") for k in KINDS if k != "async-1f1b" and "measure" in pricing]
    for kind, costs in runs:
        name = kind if costs is None else f"{kind}, measured"
        start = time.perf_counter()
        pm = run.pipeline(kind, costs)
        vg = pm.value_and_grad(run.loss_fn)
        loss, grads = jax.block_until_ready(vg(params, x, y))
        first = time.perf_counter() - start
        _, step = pm.program(params, x, y, run.loss_fn)
        error = max(
            float(jnp.max(jnp.abs(g - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))
            for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
        )
        loss_error = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
        notes[name] = (
            f"{len(step._low.plan.updates):4d} ticks ({step._low.ticks.fused_groups()} fused)"
            f"  first call {first:6.1f} s"
            f"  loss err {loss_error:.1e}  worst grad err {error:.1e} ({pm.schedule.kind})"
        )
        programs[name] = lambda vg=vg: vg(params, x, y)
        pipelines[name] = (pm, step)
        print(f"   compiled {name}: {notes[name]}", flush=True)
    times = round_times(programs, run.rounds)
    base = times["lax.scan"]
    print(f"2. {run.rounds} rounds; median ms, and the median per-round ratio over lax.scan:")
    for name, t in times.items():
        q1, med, q3 = quartiles([a / b for a, b in zip(t, base, strict=True)])
        print(
            f"   {name:27s} {quartiles(t)[1] * 1e3:8.2f} ms  {med:5.3f} [{q1:.3f}, {q3:.3f}]"
            f"  {notes.get(name, '')}"
        )
    return times, pipelines


def against_price(run: Run, times: dict, pipelines: dict) -> None:
    """Part 3: the ops timed alone, and each step against its table's lockstep price."""
    from benchmarks.common import quartiles
    from pjit_pipe.simulator.simulate import packed_time

    scan_mb = quartiles(times["lax.scan"])[1] * 1e3 / run.m
    print(f"3. lax.scan per microbatch {scan_mb:.3f} ms; ops alone (ms):")
    measured = {}
    for kind, (pm, step) in pipelines.items():
        chunks = pm.schedule.chunks
        if chunks not in measured:
            measured[chunks] = pm.measure_costs(run.params, run.x, run.y, run.loss_fn)
            ms = pm.stage_times  # seconds, per virtual stage
            for s in range(len(ms.f)):
                print(
                    f"   {chunks} chunk(s), stage {s}: F {ms.f[s] * 1e3:.3f}  B {ms.b[s] * 1e3:.3f}"
                    f"  W {ms.w[s] * 1e3:.3f}  BW {ms.bw[s] * 1e3:.3f}"
                    f"  F not split {ms.f_fused[s] * 1e3:.3f}"
                )
            print(
                f"   {chunks} chunk(s): the loss stage's F + BW as one program {ms.fbw * 1e3:.3f}"
            )
            print(f"   {chunks} chunk(s): the tick {ms.tick * 1e3:.4f}", flush=True)
        table = step._low.ticks
        if table is None:
            continue
        priced = packed_time(table, measured[chunks])
        ran = quartiles(times[kind])[1] * 1e3
        print(
            f"   {kind:27s} step {ran:8.2f} ms  priced {priced:8.2f} ms  step/priced {ran / priced:.3f}"
        )


def split_against_fused(run: Run, x: Any, y: Any) -> None:
    """Part 4: one microbatch's value_and_grad as one program, and as a forward
    program and a backward program that pass the vjp residuals through memory."""
    import jax
    import jax.numpy as jnp

    from benchmarks.common import quartiles, round_times

    params = run.params

    def loss(p, x, y):
        return run.loss_fn(run.model.apply(p, x), y)

    fused = jax.jit(jax.value_and_grad(loss))
    programs, stored = {"value_and_grad": lambda: fused(params, x, y)}, {}
    policies = (("every residual", None), ("dots_saveable", jax.checkpoint_policies.dots_saveable))
    for name, policy in policies:
        stage = loss if policy is None else jax.checkpoint(loss, policy=policy)
        forward = jax.jit(lambda p, x, y, stage=stage: jax.vjp(lambda p: stage(p, x, y), p))
        backward = jax.jit(lambda pullback: pullback(jnp.ones(())))
        _, pullback = forward(params, x, y)  # a pytree of the residuals
        stored[name] = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(pullback))
        programs[f"F, {name}"] = lambda f=forward: f(params, x, y)
        programs[f"BW, {name}"] = lambda b=backward, r=pullback: b(r)
    t = {k: quartiles(v)[1] * 1e3 for k, v in round_times(programs, run.rounds).items()}
    print(f"4. one microbatch; value_and_grad {t['value_and_grad']:.3f} ms; F + BW (ms):")
    for name, size in stored.items():
        f, bw = t[f"F, {name}"], t[f"BW, {name}"]
        print(
            f"   {name:15s} F {f:.3f}  BW {bw:.3f}  sum {f + bw:.3f}"
            f"  over value_and_grad {(f + bw) / t['value_and_grad']:.2f}"
            f"  residuals {size / 2**20:.1f} MiB"
        )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", help="comma-separated (default: all three on a GPU machine)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--idle", type=int, default=256, help="empty ticks appended in part 1")
    ap.add_argument("--quick", action="store_true", help="the tiny GPT (always without a GPU)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mode")
    ap.add_argument(
        "--stages", type=int, default=1, help="pipeline positions, one device each (mesh 1xP)"
    )
    ap.add_argument(
        "--pricing",
        default="unit,measure",
        help="part 2's costs, comma-separated: unit (the default costs), measure",
    )
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # set in the child processes
    args = ap.parse_args(argv)
    pricing = tuple(args.pricing.split(","))
    if not pricing or set(pricing) - {"unit", "measure"}:
        ap.error(f"--pricing: expected unit, measure or both, got {args.pricing!r}")
    if args.mode is not None:
        run_mode(args.mode, args.rounds, args.quick, args.idle, args.stages, pricing)
        return
    gpu = shutil.which("nvidia-smi") is not None  # not jax: the parent must not take the GPU
    modes = (args.modes or ("off,default,conditional" if gpu else "default")).split(",")
    quick = args.quick or not gpu
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    for mode in modes:
        flags = f"{os.environ.get('XLA_FLAGS', '')} {MODES[mode]}".strip()
        child = [
            sys.executable,
            "-m",
            "benchmarks.bench_gpu",
            "--mode",
            mode,
            "--rounds",
            str(args.rounds),
        ]
        child += ["--idle", str(args.idle), "--stages", str(args.stages)]
        child += ["--quick"] if quick else []
        child += ["--pricing", args.pricing]
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
