"""What the compiled tick loop costs next to the event-driven schedule.

1. The lockstep grid: lockstep_period / steady_period (4
   iterations) for every kind at P=4 m=8 and P=8 m=32 under costs 1,1,1,0,
   1,2,1,0 and 5,6,4,1, before (one op per device per tick) and after tick
   packing (tick_packing/packer.py): within the schedule's own peak memory (the
   default: the compiled program holds no more activations) and unbounded,
   with the unbounded table's peak activation memory next to the schedule's own;
   the own-peak table's lane order (ir/ticks.py) and whether it defers its late
   channel (tick_packing/send_timing.py), and the own-peak period with
   the lane order F, B, W alone (what packing gave before B, W, F existed),
   and the lower bound no tick table beats (simulator.bounds), all over the
   event-driven steady period.
2. Re-routed zb-h1 on a 4x4 mesh with one and with two failures.
3. Staggering in the compiled program: P=4 m=8, 4 iterations, costs 1,2,1,0,
   the packed lockstep_period of zb-h2 and of re-routed 4x4 variants,
   synchronous and staggered, within the own peak and unbounded.
4. Messages on a 4x4 mesh with one and with two failures (zb-h1, m=8, costs
   1,2,1,0, packed), in units of one message buffer: the ppermutes a tick
   runs (one per grid shift, or the fewest partial permutations,
   lowering/comms/routes.py), how many run per iteration (every tick, or only in
   the ticks some device uses them), and what the busiest device sends.
5. With --compile: the seconds to compile the tiny GPT's train step on 2x4
   (zb-h1, m=8), one op per tick against the packed table, and the table
   packed for costs 5,6,4,1 (deferred).
6. With --step-time (alone): seconds per compiled train step of the tiny GPT
   on 2x4 and of a dense MLP on 1x4 (CPU: compare figures of one run only).

With --polish SECONDS (alone): the synchronous cases of the grid (P=4 m=8
and, without --quick, P=8 m=32) packed within their own peak by the greedy, then polished by exact solves of windows of
ticks (`pack_ticks(..., polish=SECONDS)`, tick_packing/tick_milp.py), with the
seconds polishing took.

With --exact SECONDS: the exact optimum of the P=4 cases (pack_ticks_exact,
HiGHS), own peak / unbounded, or [lower bound, best found] where HiGHS does
not prove it within SECONDS per solve.

Run: python -m benchmarks.bench_lockstep [--quick] [--compile] [--exact SECONDS]
     python -m benchmarks.bench_lockstep [--messages] [--step-time] [--compile-only]
     python -m benchmarks.bench_lockstep --polish SECONDS
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import math
import time

from benchmarks.common import kind_cases, periods, rerouted_cases
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ticks import FORWARD_FIRST
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.simulator.bounds import lockstep_lower_bound
from pjit_pipe.tick_packing.exact_table import exact_bounds
from pjit_pipe.tick_packing.packer import pack_ticks


def optimum(schedule, costs: Costs, event: float, seconds: float) -> str:
    """The exact engine's one-iteration optimum over the event steady period, own peak /
    unbounded (a synchronous table's steady period is one iteration's time): the
    optimum when HiGHS proves it in `seconds`, else [lower bound, best found]."""
    out = []
    for mem_limit in (None, math.inf):
        found = exact_bounds(schedule, costs, mem_limit, seconds)
        if found.optimal:
            out.append(f"{found.time / event:.3f}")
        else:
            out.append(f"[{max(found.bound, 0) / event:.2f}, {found.time / event:.3f}]")
    return " / ".join(out)


def row(label: str, schedule, costs_text: str, exact: float = 0.0) -> tuple[float, float, float]:
    costs = Costs.parse(costs_text)
    start = time.perf_counter()
    event, before, after, chosen = periods(schedule, costs)
    _, _, free, table = periods(schedule, costs, math.inf)
    took = time.perf_counter() - start
    # What no tick table beats, whatever its memory: a synchronous schedule's period
    # is one iteration's table. (Staggered iterations overlap: no such bound.)
    floor = math.nan if schedule.staggered else lockstep_lower_bound(schedule, costs) / event
    forward_first = periods(schedule, costs, orders=(FORWARD_FIRST,))[2]
    order = ", ".join(chosen.order) + (" (deferred)" if chosen.deferred else "")
    own = max(peak_memory(schedule).values())
    packed = max(table.peak_memory().values())
    best = f" {optimum(schedule, costs, event, exact)} |" if exact else ""
    print(
        f"| {label} | {costs_text} | {event:g} | {before / event:.3f} | {after / event:.3f} "
        f"| {order} | {forward_first / event:.3f} | {free / event:.3f} | {own:g} -> {packed:g} "
        f"| {'-' if math.isnan(floor) else f'{floor:.3f}'} | {took:.1f} |{best}",
        flush=True,
    )
    return after / event, free / event, floor


def grid(sizes, exact: float = 0.0) -> list[tuple[float, float, float]]:
    """The table; with `exact` > 0, the exact optimum of the P=4 cases too (HiGHS,
    `exact` seconds per solve). Returns the (own peak, unbounded, lower bound)
    ratios of the cases that count (async-1f1b's table keeps its stream order: not
    packed)."""
    extra = " optimum (own peak / unbounded) |" if exact else ""
    print(
        "| kind, P, m | costs | steady | lockstep/steady before | after (own peak) "
        "| its lane order | own peak, F, B, W only "
        f"| after (unbounded) | peak memory unbounded | no table below | s |{extra}"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if exact else ""))
    ratios = []
    for label, sched, costs_text in kind_cases(sizes, with_async=True):
        # An asynchronous table keeps its stream order: nothing to optimize.
        solve = exact if sched.stages == 4 and not sched.asynchronous else 0.0
        ratio = row(label, sched, costs_text, solve)
        if not sched.asynchronous:
            ratios.append(ratio)
    for label, sched, costs_text in rerouted_cases():
        ratios.append(row(label, sched, costs_text))
    return ratios


def polished(seconds: float, sizes) -> None:
    """Own-peak lockstep/steady: the greedy's table against the polished one."""
    print("| kind, P, m | costs | greedy | polished | s |")
    print("|---|---|---|---|---|")
    counts = [0, 0, 0]
    for label, sched, costs_text in kind_cases(sizes, with_async=False):
        costs = Costs.parse(costs_text)
        start = time.perf_counter()
        ratios = [
            after / event
            for event, _, after, _ in (periods(sched, costs, polish=p) for p in (0.0, seconds))
        ]
        took = time.perf_counter() - start
        print(
            f"| {label} | {costs_text} | {ratios[0]:.3f} | {ratios[1]:.3f} | {took:.0f} |",
            flush=True,
        )
        counts = [
            counts[0] + 1,
            counts[1] + (ratios[0] <= 1.05),
            counts[2] + (ratios[1] <= 1.05),
        ]
    print(
        f"\nwithin 1.05 x steady_period: {counts[1]} of {counts[0]} greedy, "
        f"{counts[2]} polished ({seconds:g} s per window)"
    )


def staggering() -> None:
    """Synchronous against staggered, packed within the own peak and unbounded. A
    re-routed schedule comes staggered (passes/reroute.py); its synchronous form is
    the same programs with the iteration barrier (every OPT is its worker's last op)."""
    costs = Costs.parse("1,2,1,0")
    zb_h2 = make_schedule("zb-h2", 4, 8, costs=costs)
    cases = {"zb-h2 P=4 m=8": (zb_h2, stagger(zb_h2))}
    for failed in ([(1, 2)], [(1, 2), (2, 0)]):
        rerouted = schedule_with_failures("zb-h1", 4, 8, 4, failed, costs, time_limit=2.0)
        sync = rerouted.replace(staggered=False, kind=rerouted.kind.replace("+stagger", ""))
        cases[f"zb-h1 4x4 m=8, {len(failed)} failed"] = (sync, rerouted)
    print(
        "\n| schedule (costs 1,2,1,0, 4 iterations) | event sync / staggered "
        "| lockstep own peak: sync / staggered (gain) | unbounded: sync / staggered (gain) |"
    )
    print("|---|---|---|---|")
    for label, (sync, stag) in cases.items():
        cells = [f"{periods(sync, costs)[0]:g} / {periods(stag, costs)[0]:g}"]
        for mem_limit in (None, math.inf):
            a, b = periods(sync, costs, mem_limit)[2], periods(stag, costs, mem_limit)[2]
            cells.append(f"{a:g} / {b:g} ({1 - b / a:.1%})")
        print(f"| {label} | {' | '.join(cells)} |", flush=True)


def messages() -> None:
    import numpy as np

    from pjit_pipe.lowering.tick_plan import build_plan

    costs = Costs.parse("1,2,1,0")
    print(
        "\n| zb-h1 4x4 m=8 (packed) | ticks | ppermutes per tick: one per shift -> fewest "
        "| ppermutes run per iteration: every tick, one per shift -> fewest -> only where used "
        "| messages the busiest device sends per tick | per iteration: every tick -> only where used |"
    )
    print("|---|---|---|---|---|---|")
    for failed in ([(1, 2)], [(1, 2), (2, 0)]):
        sched = schedule_with_failures("zb-h1", 4, 8, 4, failed, costs, time_limit=2.0)
        devices = tuple(sched.alive_workers)
        plan = build_plan(pack_ticks(sched, costs), False, devices)
        T, channels = plan.ticks, (plan.act_shifts, plan.grad_shifts)
        by_shift = sum(len(_grid_shifts(c, devices)) for c in channels)
        fewest = len(plan.act_shifts) + len(plan.grad_shifts)
        run = [plan.sends[i] for i in plan.rows.sends[0]]  # each tick's (act, grad) ppermutes
        gated = sum(len(a) + len(g) for a, g in run)
        per_tick, every, only = (np.zeros(len(devices), int) for _ in range(3))
        for k, channel in enumerate(channels):
            for i, (_, pairs) in enumerate(channel):
                for src, _ in pairs:  # a device sends one message per pair it sources
                    per_tick[src] += 1
                    every[src] += T
                    only[src] += sum(i in r[k] for r in run)
        print(
            f"| {len(failed)} failed | {T} | {by_shift} -> {fewest} "
            f"| {by_shift * T} -> {fewest * T} -> {gated} | {per_tick.max()} "
            f"| {every.max()} -> {only.max()} |",
            flush=True,
        )


def _grid_shifts(channel, devices) -> set[tuple[int, int]]:
    """The distinct (replica, position) shifts of a 4x4 grid a channel's pairs make."""
    return {
        ((devices[d].replica - devices[s].replica) % 4, (devices[d].stage - devices[s].stage) % 4)
        for _, pairs in channel
        for s, d in pairs
    }


def compile_times() -> None:
    import jax
    import numpy as np
    import optax

    import pjit_pipe as pp
    from pjit_pipe.lowering import LoweringOptions, lower
    from pjit_pipe.models import GPT, GPTConfig, lm_loss
    from pjit_pipe.models.char_corpus import CharCorpus

    corpus = CharCorpus.load()
    config = GPTConfig.tiny(vocab=corpus.vocab)
    x, y = (
        jax.numpy.asarray(a) for a in corpus.batch(np.random.default_rng(0), 32, config.seq_len)
    )
    pm = pp.pipeline(
        GPT(config),
        stages=4,
        microbatches=8,
        schedule="zb-h1",
        mesh=pp.make_mesh(data=2, stage=4),
        optimizer=optax.adam(1e-3),
    )
    params = pm.init(jax.random.key(0), x)
    cut = pm.cut(params, x)
    stage_params = cut.split(params)
    table = pack_ticks(pm.schedule, Costs(1, 2, 1), 1)  # packs several ops per tick
    # Under the Zero Bubble paper's costs the packer defers the gradients.
    deferred = pack_ticks(pm.schedule, Costs(5, 6, 4, 1), 1)
    print("\n| tiny GPT 2x4 zb-h1 m=8 | ticks | compile train step (s) |")
    print("|---|---|---|")
    tables = (("one op per tick", None), ("packed", table))
    if deferred.deferred:
        tables += (("packed for 5,6,4,1, deferred", deferred),)
    for label, ticks in tables:
        step = lower(
            ticks,
            cut.stage_fns(),
            lm_loss,
            pm.mesh,
            stage_params,
            x,
            y,
            LoweringOptions(optimizer=optax.adam(1e-3)),
        )
        opt = step.init_opt_state(stage_params)
        args = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (stage_params, opt, x, y)
        )
        start = time.perf_counter()
        step._train.lower(*args).compile()
        seconds = time.perf_counter() - start
        print(f"| {label} | {step._low.plan.ticks} | {seconds:.1f} |", flush=True)


def step_times(calls: int = 20) -> None:
    """Seconds of the first train step call (it compiles) and per compiled train
    step (median and fastest of `calls` after it) of the tiny GPT on 2x4 (zb-h1, m=8, the
    packed table) and of a dense MLP on 1x4 (1f1b, m=8, 256 wide, 64 rows per
    microbatch)."""
    import jax
    import numpy as np
    import optax

    import pjit_pipe as pp
    from pjit_pipe.lowering import LoweringOptions, lower
    from pjit_pipe.models import GPT, GPTConfig, lm_loss
    from pjit_pipe.models.char_corpus import CharCorpus

    corpus = CharCorpus.load()
    config = GPTConfig.tiny(vocab=corpus.vocab)
    x, y = (
        jax.numpy.asarray(a) for a in corpus.batch(np.random.default_rng(0), 32, config.seq_len)
    )
    pm = pp.pipeline(
        GPT(config), stages=4, microbatches=8, schedule="zb-h1", mesh=pp.make_mesh(data=2, stage=4)
    )
    params = pm.init(jax.random.key(0), x)
    cut = pm.cut(params, x)
    gpt = (pm.schedule, cut.stage_fns(), lm_loss, pm.mesh, cut.split(params), x, y)
    gpt_ticks = pack_ticks(pm.schedule, Costs(1, 2, 1), 1)

    width, rows, P, m = 256, 64, 4, 8
    keys = jax.random.split(jax.random.key(1), P + 2)
    mlp_params = [{"w": jax.random.normal(k, (width, width)) / 16} for k in keys[:P]]
    mlp_x = jax.random.normal(keys[P], (m * rows, width))
    mlp_y = jax.random.randint(keys[P + 1], (m * rows,), 0, width)

    def dense(p, a):
        return jax.numpy.tanh(a @ p["w"])

    def xent(logits, labels):
        logp = jax.nn.log_softmax(logits)
        return -jax.numpy.mean(jax.numpy.take_along_axis(logp, labels[:, None], axis=1))

    mesh = pp.make_mesh(data=1, stage=P)
    mlp = (make_schedule("1f1b", P, m), [dense] * P, xent, mesh, mlp_params, mlp_x, mlp_y)
    print("\n| train step | ticks | first call (compile) s | s per step (median) | (fastest) |")
    print("|---|---|---|---|---|")
    for label, (_, fns, loss, mesh, stage_params, xb, yb), ticks in (
        ("tiny GPT 2x4 zb-h1 m=8 packed", gpt, gpt_ticks),
        ("MLP 1x4 1f1b m=8, 256 wide", mlp, mlp[0]),
    ):
        opt = optax.adam(1e-3)
        step = lower(ticks, fns, loss, mesh, stage_params, xb, yb, LoweringOptions(optimizer=opt))
        state = step.init_opt_state(stage_params)
        start = time.perf_counter()
        jax.block_until_ready(step.train_step(stage_params, state, xb, yb))
        first = time.perf_counter() - start
        took = []
        for _ in range(calls):
            start = time.perf_counter()
            jax.block_until_ready(step.train_step(stage_params, state, xb, yb))
            took.append(time.perf_counter() - start)
        print(
            f"| {label} | {step._low.plan.ticks} | {first:.1f} | {np.median(took):.4f} "
            f"| {min(took):.4f} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P=4 m=8 only")
    parser.add_argument("--compile", action="store_true", help="also time the tiny GPT compile")
    parser.add_argument(
        "--exact",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also solve the P=4 cases exactly (HiGHS, SECONDS per solve; minutes in all)",
    )
    parser.add_argument(
        "--polish",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="only the greedy against polished tables (SECONDS per window)",
    )
    parser.add_argument("--messages", action="store_true", help="only the messages table")
    parser.add_argument("--step-time", action="store_true", help="only the train step times")
    parser.add_argument("--compile-only", action="store_true", help="only the compile times")
    args = parser.parse_args(argv)
    if args.polish:
        polished(args.polish, [(4, 8)] if args.quick else [(4, 8), (8, 32)])
        return
    if args.messages or args.step_time or args.compile_only:
        for wanted, part in ((args.messages, messages), (args.step_time, step_times)):
            if wanted:
                part()
        if args.compile_only:
            compile_times()
        return
    sizes = [(4, 8)] if args.quick else [(4, 8), (8, 32)]
    ratios = grid(sizes, args.exact)
    own, free = (sum(r[i] <= 1.05 for r in ratios) for i in (0, 1))
    out_of_reach = sum(r[2] > 1.05 for r in ratios)
    print(
        f"\nlockstep_period <= 1.05 x steady_period in {own} of {len(ratios)} cases within "
        f"the own peak, {free} unbounded (async-1f1b not counted); in {out_of_reach} no "
        "tick table can be (simulator.bounds.lockstep_lower_bound)"
    )
    staggering()
    messages()
    if args.compile:
        compile_times()


if __name__ == "__main__":
    main()
