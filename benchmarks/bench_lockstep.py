"""What the compiled tick loop costs next to the event-driven schedule.

1. The acceptance grid of issue 11: lockstep_period / steady_period (4
   iterations) for every kind at P=4 m=8 and P=8 m=32 under costs 1,1,1,0,
   1,2,1,0 and 5,6,4,1, before (one op per device per tick) and after tick
   packing (passes/pack_ticks.py): within the schedule's own peak memory (the
   default: the compiled program holds no more activations) and unbounded,
   with the unbounded table's peak activation memory next to the schedule's own.
2. Re-routed zb-h1 on a 4x4 mesh with one and with two failures.
3. Staggering in the compiled program: P=4 m=8, 4 iterations, costs 1,2,1,0,
   the packed lockstep_period of zb-h2 and of a re-routed 4x4 variant,
   synchronous and staggered.
4. Messages a device sends on a 4x4 mesh with one and with two failures
   (zb-h1, m=8, costs 1,2,1,0), in units of one message buffer: every tick
   runs each ppermute of the plan; before, one channel ran every shift,
   after, activations and gradients run their own shifts only.
5. With --compile: the seconds to compile the tiny GPT's train step on 2x4
   (zb-h1, m=8), one op per tick against the packed table.

Run: python benchmarks/bench_lockstep.py [--quick] [--compile]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import math
import time

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.passes import stagger
from pjit_pipe.passes.pack_ticks import pack_ticks
from pjit_pipe.schedules import KINDS, make_schedule, schedule_with_failures
from pjit_pipe.simulator.simulate import simulate

ITERATIONS = 4
COSTS = ("1,1,1,0", "1,2,1,0", "5,6,4,1")


def periods(
    schedule, costs: Costs, mem_limit: float | None = None
) -> tuple[float, float, float, PackedTicks]:
    """(event steady period, one-op-per-tick lockstep period, packed lockstep period, table);
    packed within `mem_limit` (None: the schedule's own peak, pack_ticks' default)."""
    event = simulate(schedule, costs, ITERATIONS).steady_period
    before = simulate(schedule, costs, ITERATIONS, mode="lockstep").steady_period
    table = pack_ticks(schedule, costs, ITERATIONS, mem_limit)
    after = simulate(schedule, costs, ITERATIONS, mode="lockstep", ticks=table).steady_period
    return event, before, after, table


def row(label: str, schedule, costs_text: str) -> float:
    costs = Costs.parse(costs_text)
    start = time.perf_counter()
    event, before, after, _ = periods(schedule, costs)
    _, _, free, table = periods(schedule, costs, math.inf)
    took = time.perf_counter() - start
    own = max(peak_memory(schedule).values())
    packed = max(table.peak_memory().values())
    print(
        f"| {label} | {costs_text} | {event:g} | {before / event:.3f} | {after / event:.3f} "
        f"| {free / event:.3f} | {own:g} -> {packed:g} | {took:.1f} |",
        flush=True,
    )
    return after / event


def grid(sizes) -> list[float]:
    print(
        "| kind, P, m | costs | steady | lockstep/steady before | after (own peak) "
        "| after (unbounded) | peak memory unbounded | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for P, m in sizes:
        for costs_text in COSTS:
            for kind in KINDS:
                chunks = 2 if kind == "interleaved-1f1b" else None
                sched = make_schedule(kind, P, m, chunks=chunks, costs=Costs.parse(costs_text))
                ratios.append(row(f"{kind} P={P} m={m}", sched, costs_text))
    for failed in ([(1, 2)], [(1, 2), (2, 0)]):
        for costs_text in ("1,2,1,0", "5,6,4,1"):
            costs = Costs.parse(costs_text)
            sched = schedule_with_failures("zb-h1", 4, 8, 4, failed, costs, time_limit=2.0)
            label = f"zb-h1 4x4 m=8, {len(failed)} failed"
            ratios.append(row(label, sched, costs_text))
    return ratios


def staggering() -> None:
    costs = Costs.parse("1,2,1,0")
    cases = {
        "zb-h2 P=4 m=8": make_schedule("zb-h2", 4, 8, costs=costs),
        "zb-h1 4x4 m=8, 1 failed": schedule_with_failures(
            "zb-h1", 4, 8, 4, [(1, 2)], costs, time_limit=2.0
        ),
    }
    print("\n| schedule (costs 1,2,1,0, 4 iterations) | lockstep synchronous | staggered | gain |")
    print("|---|---|---|---|")
    for label, sched in cases.items():
        sync = periods(sched, costs)[2]
        stag = periods(stagger(sched), costs)[2]
        print(f"| {label} | {sync:g} | {stag:g} | {1 - stag / sync:.1%} |", flush=True)


def messages() -> None:
    from pjit_pipe.lowering.plan import build_plan

    costs = Costs.parse("1,2,1,0")
    print(
        "\n| zb-h1 4x4 m=8 | shifts per tick before | after (act + grad) | "
        "ticks before | after | messages per device per iteration before | after |"
    )
    print("|---|---|---|---|---|---|---|")
    for failed in ([(1, 2)], [(1, 2), (2, 0)]):
        sched = schedule_with_failures("zb-h1", 4, 8, 4, failed, costs, time_limit=2.0)
        devices = tuple(sched.alive_workers)
        old = build_plan(PackedTicks.one_op_per_tick(sched), False, devices)
        new = build_plan(pack_ticks(sched, costs), False, devices)
        union = len({k for k, _ in old.act_shifts} | {k for k, _ in old.grad_shifts})
        per_tick = len(new.act_shifts) + len(new.grad_shifts)
        print(
            f"| {len(failed)} failed | {union} | {len(new.act_shifts)} + {len(new.grad_shifts)} "
            f"| {old.ticks} | {new.ticks} | {union * old.ticks} | {per_tick * new.ticks} |",
            flush=True,
        )


def compile_times() -> None:
    import jax
    import numpy as np
    import optax

    import pjit_pipe as pp
    from models import GPT, GPTConfig, lm_loss
    from models.text import CharCorpus
    from pjit_pipe.lowering import lower

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
    print("\n| tiny GPT 2x4 zb-h1 m=8 | ticks | compile train step (s) |")
    print("|---|---|---|")
    for label, ticks in (("one op per tick", None), ("packed", table)):
        step = lower(
            pm.schedule,
            cut.stage_fns(),
            lm_loss,
            pm.mesh,
            stage_params,
            x,
            y,
            optimizer=optax.adam(1e-3),
            ticks=ticks,
        )
        opt = step.init_opt_state(stage_params)
        args = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (stage_params, opt, x, y)
        )
        start = time.perf_counter()
        step._train.lower(*args).compile()
        seconds = time.perf_counter() - start
        print(f"| {label} | {step._low.plan.ticks} | {seconds:.1f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="P=4 m=8 only")
    parser.add_argument("--compile", action="store_true", help="also time the tiny GPT compile")
    args = parser.parse_args(argv)
    sizes = [(4, 8)] if args.quick else [(4, 8), (8, 32)]
    ratios = grid(sizes)
    met = sum(r <= 1.05 for r in ratios)
    print(f"\nlockstep_period <= 1.05 x steady_period in {met} of {len(ratios)} cases")
    staggering()
    messages()
    if args.compile:
        compile_times()


if __name__ == "__main__":
    main()
