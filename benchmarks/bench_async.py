"""Asynchronous 1F1B (PipeDream / PipeOptim): throughput and convergence.

1. Throughput: the simulated steady period of async-1f1b against 1f1b and
   zb-h1 (their optimizer staggered) at P=4 and 8, m=2P, costs 1,1,1 and 1,2,1;
   event-driven, and the lockstep tick table the frontend compiles (packed by
   `pack_ticks`; async-1f1b is not packed), run over several back-to-back iterations.
2. Carrying across calls: the lockstep time of one compiled call (one batch) of
   async-1f1b that drains (fills and drains its pipeline) against one that
   carries its in-flight microbatches (runs the steady window,
   lowering/async_pipeline/async_carry.py), and the measured wall time of a compiled step of
   the tiny GPT on 1x4 for 1f1b, zb-h1, async draining and async carrying,
   in one run (`--calls` timed calls each, taking turns).
3. Convergence: the tiny GPT on the bundled corpus on a 1x4 mesh, m=4, with
   adam and with SGD-momentum: synchronous 1f1b against async-1f1b with
   `latest`, `stash` and `predict` weights, at the same samples (every step
   one global batch; async takes m updates per step, one per microbatch) and
   the same learning rate, at a normal and a high learning rate, over
   `--steps` steps and `--seeds` seeds. Each compiled call runs
   CALL_ITERATIONS iterations (asynchronous across their boundaries). Prints the mean loss of the last 20
   steps (mean over seeds) and draws the curves to `--plot`.

The learning rate is injected (optax.inject_hyperparams) so one compiled
program per (schedule, optimizer) serves every rate and seed.

Run: python -m benchmarks.bench_async [--steps N] [--seeds K] [--plot FILE.png]
    [--calls N] [--skip-convergence]
The defaults are a short run for a 2-core machine; the full study is
    python -m benchmarks.bench_async --steps 300 --seeds 3
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pjit_pipe as pp
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.lowering.async_pipeline.steady_window import steady_window
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.char_corpus import CharCorpus
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator.simulate import packed_time, simulate
from pjit_pipe.tick_packing.packer import pack_ticks

P, M, BATCH = 4, 4, 16
# Iterations per compiled call: asynchronous 1F1B runs without a flush inside a
# call and drains between calls (see the README), so calls hold several.
CALL_ITERATIONS = 10
RUNS = [
    ("1f1b", None),
    ("async-1f1b", "latest"),
    ("async-1f1b", "stash"),
    ("async-1f1b", "predict"),
]
# (name, optax factory, normal rate, high rate)
OPTIMIZERS = [
    ("adam", optax.adam, 3e-3, 3e-2),
    ("sgd-momentum", lambda learning_rate: optax.sgd(learning_rate, momentum=0.9), 0.1, 0.25),
]


def lockstep_period(schedule, costs: Costs, iterations: int = 8) -> float:
    """Steady period of the tick table the frontend compiles (`pack_ticks`: packed for
    the synchronous kinds, one op per tick for async-1f1b) over back-to-back iterations."""
    ticks = pack_ticks(schedule, costs, iterations)
    return simulate(schedule, costs, iterations, mode="lockstep", ticks=ticks).steady_period


def throughput() -> None:
    print("steady period per iteration (ideal m(F+B+W)); 1f1b and zb-h1 staggered")
    print(f"{'P':>2} {'costs':>7} {'kind':>11} {'ideal':>6} {'event':>7} {'lockstep':>9}")
    for stages in (4, 8):
        m = 2 * stages
        for costs in (Costs(1, 1, 1), Costs(1, 2, 1)):
            for kind in ("1f1b", "zb-h1", "async-1f1b"):
                sched = stagger(make_schedule(kind, stages, m))
                event = simulate(sched, costs, iterations=12).steady_period
                lock = lockstep_period(sched, costs)
                tag = f"{costs.f:g},{costs.b:g},{costs.w:g}"
                print(
                    f"{stages:>2} {tag:>7} {kind:>11} {costs.ideal(sched):>6g} {event:>7.2f} {lock:>9.2f}"
                )


def carrying_periods() -> None:
    """Lockstep time of one compiled call of async-1f1b (one batch): the draining
    program fills and drains its pipeline, the carrying one runs the steady window."""
    print("async-1f1b, lockstep time of one call: draining (fill + drain) vs carrying (window)")
    print(f"{'P':>2} {'costs':>7} {'ideal':>6} {'draining':>9} {'carrying':>9} {'ratio':>6}")
    for stages in (4, 8):
        m = 2 * stages
        sched = make_schedule("async-1f1b", stages, m)
        window = steady_window(sched, False, tuple(sched.alive_workers))
        for costs in (Costs(1, 1, 1), Costs(1, 2, 1)):
            drain = packed_time(PackedTicks.one_op_per_tick(sched, 1), costs)
            carry = packed_time(PackedTicks(sched, 1, window.ticks), costs)
            tag = f"{costs.f:g},{costs.b:g},{costs.w:g}"
            print(
                f"{stages:>2} {tag:>7} {costs.ideal(sched):>6g} {drain:>9g} {carry:>9g}"
                f" {carry / drain:>6.2f}"
            )


def compiled_step_times(calls: int) -> None:
    """Wall time of one compiled step (one global batch) of the tiny GPT, 1x4, adam,
    through the frontend: 1f1b and zb-h1, async-1f1b draining and carrying. The
    runs take turns call by call, so load on the machine hits them alike."""
    corpus = CharCorpus.load()
    config = GPTConfig.tiny(vocab=corpus.vocab)
    mesh = pp.make_mesh(data=1, stage=P)
    rng = np.random.default_rng(0)
    batches = [corpus.batch(rng, BATCH, config.seq_len) for _ in range(calls + 2)]
    params = GPT(config).init(jax.random.key(0), batches[0][0])
    runs = {}
    for name, kind, carry in (
        ("1f1b", "1f1b", False),
        ("zb-h1", "zb-h1", False),
        ("async draining", "async-1f1b", False),
        ("async carrying", "async-1f1b", True),
    ):
        pm = pp.pipeline(
            GPT(config),
            stages=P,
            microbatches=M,
            schedule=kind,
            mesh=mesh,
            optimizer=optax.adam(1e-3),
        )
        step = pm.train_step(lm_loss, carry=carry)
        state = step.init(params, batches[0])
        for b in batches[:2]:  # compile, then one warm call
            state, loss = step(state, b)
        jax.block_until_ready((state, loss))
        runs[name] = [step, state, []]
    for b in batches[2:]:
        for run in runs.values():
            step, state, times = run
            start = time.perf_counter()
            state, loss = step(state, b)
            jax.block_until_ready((state, loss))
            times.append(time.perf_counter() - start)
            run[1] = state
    base = statistics.median(runs["1f1b"][2])
    print(f"compiled step time, tiny GPT 1x{P}, m={M}, batch {BATCH}, median of {calls} (CPU):")
    for name, (_, _, times) in runs.items():
        t = statistics.median(times)
        print(f"  {name:>14}: {1e3 * t:7.1f} ms  ({t / base:.2f}x 1f1b)")


def with_rate(opt_state, rate: float):
    """An inject_hyperparams state with its learning rate set to `rate`."""
    hyper = dict(opt_state.hyperparams)
    hyper["learning_rate"] = jnp.asarray(rate, hyper["learning_rate"].dtype)
    return opt_state._replace(hyperparams=hyper)


def compiled(kind: str, weights: str | None, optimizer, config, mesh, params, batch):
    """(stage cut, PipelineStep) running CALL_ITERATIONS iterations per call."""
    pm = pp.pipeline(GPT(config), stages=P, microbatches=M, schedule=kind, mesh=mesh)
    cut = pm.cut(params, batch[0])
    step = lower(
        PackedTicks.one_op_per_tick(pm.schedule, CALL_ITERATIONS),
        cut.stage_fns(),
        lm_loss,
        mesh,
        cut.split(params),
        *batch,
        LoweringOptions(optimizer=optimizer, async_weights=weights),
    )
    return cut, step


def convergence(steps: int, seeds: int, plot: str | None) -> None:
    corpus = CharCorpus.load()
    config = GPTConfig.tiny(vocab=corpus.vocab)
    mesh = pp.make_mesh(data=1, stage=P)
    calls = -(-steps // CALL_ITERATIONS)
    curves: dict[tuple, list[list[float]]] = {}
    step_times: dict[str, list[float]] = {}
    for opt_name, factory, normal, high in OPTIMIZERS:
        optimizer = optax.inject_hyperparams(factory)(learning_rate=normal)
        for kind, weights in RUNS:
            name = kind if weights is None else f"async {weights}"
            example = corpus.batch(np.random.default_rng(0), BATCH, config.seq_len)
            params = GPT(config).init(jax.random.key(0), example[0])
            cut, step = compiled(kind, weights, optimizer, config, mesh, params, example)
            if weights is not None:
                kib = step.async_weight_bytes() / 1024
                print(f"{name}: extra weight copies {kib:.0f} KiB per device", flush=True)
            for rate in (normal, high):
                for seed in range(seeds):
                    rng = np.random.default_rng(seed)
                    stage_params = cut.split(GPT(config).init(jax.random.key(seed), example[0]))
                    opt_state = [with_rate(optimizer.init(p), rate) for p in stage_params]
                    losses: list[float] = []
                    for _ in range(calls):
                        data = [
                            corpus.batch(rng, BATCH, config.seq_len) for _ in range(CALL_ITERATIONS)
                        ]
                        xs, ys = (jnp.stack(b) for b in zip(*data, strict=True))
                        start = time.perf_counter()
                        stage_params, opt_state, loss = step.train_step(
                            stage_params, opt_state, xs, ys
                        )
                        losses += [float(v) for v in loss]
                        step_times.setdefault(name, []).append(
                            (time.perf_counter() - start) / CALL_ITERATIONS
                        )
                    curves.setdefault((opt_name, rate, name), []).append(losses[:steps])
                last = [np.mean(c[-20:]) for c in curves[(opt_name, rate, name)]]
                print(
                    f"{opt_name:>12} lr {rate:<6g} {name:>13}: last-20 loss {np.mean(last):.4f}"
                    f" (seeds: {', '.join(f'{v:.4f}' for v in last)})",
                    flush=True,
                )
    print("median time per iteration (ms, CPU; the median leaves out the first call's compile):")
    for name, times in step_times.items():
        print(f"  {name:>13}: {1e3 * statistics.median(times):.1f}")
    if plot:
        draw(curves, plot, steps, seeds)


def draw(curves: dict, path: str, steps: int, seeds: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = {(o, r) for o, r, _ in curves}
    panels = sorted(rates, key=lambda k: ([o for o, *_ in OPTIMIZERS].index(k[0]), k[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (opt_name, rate) in zip(axes[0], panels, strict=True):
        for kind, weights in RUNS:
            name = kind if weights is None else f"async {weights}"
            mean = np.mean(curves[(opt_name, rate, name)], axis=0)
            ax.plot(np.arange(len(mean)), mean, label=name, lw=1.2)
        ax.set_title(f"{opt_name}, lr {rate:g}")
        ax.set_xlabel("step (one global batch)")
        ax.set_ylim(1.5, 4.5)  # a diverging run leaves the panel through the top
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"training loss (mean of {seeds} seed(s))")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"tiny GPT, 1x{P}, m={M}, batch {BATCH}, {steps} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--plot", default=None, help="loss-curve picture (.png)")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per step kind")
    args = parser.parse_args(argv)
    throughput()
    carrying_periods()
    compiled_step_times(args.calls)
    if not args.skip_convergence:
        convergence(args.steps, args.seeds, args.plot)


if __name__ == "__main__":
    main()
