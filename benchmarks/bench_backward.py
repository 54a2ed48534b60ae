"""The split backward: what B, W and B+W cost against the fused BW, per stage and end to end.

1. One middle stage (GPT blocks; pre-norm residual MLP blocks), each at two
   widths: the time of B, W, B+W and BW of one microbatch, as jitted functions
   of the residuals F stored. "before": W re-runs the stage pullback (the old
   split); "after": B stores the site cotangents (parameter-sized reductions
   for biases and norm scales) and W transposes only the parameter-reading
   ops (split_backward.py). Ratios are over the fused BW of
   the same run. Targets: after B+W <= 1.10x BW, after W <= 0.6x BW. XLA's
   flop and bytes-accessed counts of the compiled functions are printed too:
   they do not depend on machine load, so they show whether B+W does more
   work than BW or only takes longer.
2. A 1x2 pipeline whose second stage holds all the work (the first is cut off
   by a `pp.boundary` marker), m=16: zb-h1 over 1f1b (target <= 1.05), both
   packed with costs measured from the model, the fixed cost of a tick
   included, as the median of per-round ratios over `--pairs` rounds of
   interleaved calls, with quartiles and tick counts; and 1f1b with its
   backward split in place (its order, each BW run as B then W) over 1f1b:
   what the split costs inside the compiled program, apart from zb-h1's order.
3. The tiny GPT on 2x4, m=8: `auto` scheduled with measured costs against
   every fixed kind (step time).
4. Memory (no timing): per stage of the tiny GPT and the residual MLP cut
   into 4, the bytes one microbatch holds in the B-pool (vjp residuals, freed
   by B) and the W-pool (W's operands + the cotangents B stores, freed by W),
   over the fused BW's residual bytes: what the memory units F +1, B -1/2,
   W -1/2 say the split holds after F (1) and after B (1/2).

Run: python -m benchmarks.bench_backward [--repeats N] [--pairs N] [--quick] [--part 1..4]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp

import pjit_pipe as pp
from benchmarks.common import HeavySecond, median_times, mse, quartiles
from pjit_pipe.lowering.compute.loss import LossLayout
from pjit_pipe.lowering.compute.stages import StageVjp
from pjit_pipe.models.gpt import GPT, Block, GPTConfig, lm_loss
from pjit_pipe.models.mlp import ResidualBlock


class Blocks(nn.Module):
    """`n` blocks made by `make`: the work of one middle pipeline stage."""

    make: object
    n: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.n):
            x = self.make()(x)
        return x


def _stage_ops(stages: StageVjp, s: int, params, act, y):
    """Jitted F, B, W, BW of stage s (s in the middle of a 3-stage chain), each as
    (jitted function, its arguments)."""
    g = jnp.ones(stages.act_avals[s + 1].shape, stages.act_avals[s + 1].dtype)
    _, res = jax.jit(lambda p, a: stages.stored_rows(s, p, a, None))(params, act)
    if s in stages.split:
        b = jax.jit(
            lambda p, r: stages.input_grad(s, p, r, g, jax.tree.map(lambda v: v[None], r.w), 0)
        )
        _, kept = b(params, res)
        kept = {k: v[0] for k, v in kept.items()}  # the W-pool row with B's cotangents
        w = jax.jit(lambda p, r: stages.weight_grad(s, p, r))
        bw = jax.jit(lambda p, r: stages.fused_grad(s, p, r, g))
        return {
            "B": (b, (params, res)),
            "W": (w, (params, res._replace(w=kept))),
            "BW": (bw, (params, res)),
        }
    pull = lambda p, r: stages.pullback(s, p, r)(g)  # noqa: E731
    b = jax.jit(lambda p, r: pull(p, r)[1])
    w = jax.jit(lambda p, r: pull(p, r)[0])
    bw = jax.jit(pull)
    return {op: (f, (params, res)) for op, f in (("B", b), ("W", w), ("BW", bw))}


def _xla_cost(f, args) -> tuple[float, float]:
    """XLA's (flops, bytes accessed) of the compiled `f(*args)`: noise-free, unlike time."""
    cost = f.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def stage_costs(name: str, module: nn.Module, x: jax.Array, repeats: int) -> dict[str, float]:
    """Median times of B, W, BW of `module` as the middle stage, before and after."""
    params = module.init(jax.random.key(0), x)
    fns = [lambda p, a: a * p, lambda p, a: module.apply(p, a), lambda p, a: a * p]
    stage_params = [jnp.ones(()), params, jnp.ones(())]
    loss = LossLayout(lambda out, y: jnp.mean(out**2)).vector  # the lowering's last-stage form
    x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    fs, flops = {}, {}
    for tag, split in (("before", ()), ("after", (1,))):
        stages = StageVjp(fns, loss, stage_params, x_aval, x_aval, split)
        for op, (f, args) in _stage_ops(stages, 1, params, x, None).items():
            fs[f"{tag} {op}"] = lambda f=f, args=args: f(*args)
            flops[f"{tag} {op}"] = _xla_cost(f, args)
    med = median_times(fs, repeats)
    bw, (bw_flops, bw_bytes) = med["before BW"], flops["before BW"]
    print(f"  {name}:")
    for tag in ("before", "after"):
        b, w, fused = (med[f"{tag} {k}"] for k in ("B", "W", "BW"))
        (fb, bb), (fw, bwb) = flops[f"{tag} B"], flops[f"{tag} W"]
        print(
            f"    {tag:6s} B {b * 1e3:7.2f} ms  W {w * 1e3:7.2f} ms  B+W {(b + w) * 1e3:7.2f} ms"
            f"  BW {fused * 1e3:7.2f} ms   B/BW {b / bw:.2f}  W/BW {w / bw:.2f}"
            f"  (B+W)/BW {(b + w) / bw:.2f}   flops: W/BW {fw / bw_flops:.2f}"
            f"  (B+W)/BW {(fb + fw) / bw_flops:.2f}   bytes: (B+W)/BW {(bb + bwb) / bw_bytes:.2f}"
        )
    return med


def per_stage(repeats: int, quick: bool) -> None:
    print("1. One middle stage, one microbatch (ratios over the fused BW before):")
    rows = 8 if quick else 16
    for d in (64, 256):
        x = jax.random.normal(jax.random.key(1), (rows, 32, d))
        stage_costs(
            f"GPT stage, 2 blocks d={d}, {rows}x32 tokens",
            Blocks(lambda d=d: Block(d, 4, 4 * d), 2),
            x,
            repeats,
        )
    for d in (256, 512):
        x = jax.random.normal(jax.random.key(1), (256, d))
        stage_costs(
            f"MLP stage, 4 blocks width {d}, 256 rows",
            Blocks(lambda d=d: ResidualBlock(4 * d), 4),
            x,
            repeats,
        )


def heavy_second_stage(pairs: int, quick: bool) -> None:
    """zb-h1 over 1f1b on the 1x2 pipeline, both packed with measured costs.

    The costs (F, B, W, C and the fixed cost of a tick, in ms) are measured
    from the model (`costs="measure"`), both schedules are made and packed
    with them, within the schedule's own memory peak (the frontend's default),
    half a unit above it, and unbounded, and, to show what the tick's price
    changes, with the tick priced at 0. Identical tables compile once. Every
    program runs once per round, in alternating order, for `pairs` rounds
    after a warm-up; the figure is the median over rounds of zb-h1's time over
    1f1b's of the same round and packing (quartiles in brackets): two programs
    timed minutes apart on shared cores differ by more than the target's 5%.
    A last program, zb-h1's table with 256 empty ticks appended, gives what an
    idle tick of the real tick body costs, to check the measured tick against.
    """
    import dataclasses
    import math
    import time

    from pjit_pipe.ir.memory import largest_peak
    from pjit_pipe.lowering import lower
    from pjit_pipe.passes.split_backward import split_backward
    from pjit_pipe.schedules import make_schedule
    from pjit_pipe.simulator.simulate import packed_time
    from pjit_pipe.tick_packing.packer import pack_ticks

    m, mb = 16, 16 if quick else 64
    model = HeavySecond(128 if quick else 256)
    x = jax.random.normal(jax.random.key(0), (m * mb, 32))
    y = jax.random.normal(jax.random.key(1), (m * mb, 8))
    mesh = pp.make_mesh(data=1, stage=2)
    params = model.init(jax.random.key(2), x)
    pm = pp.pipeline(model, stages=2, microbatches=m, schedule="1f1b", mesh=mesh)
    cut = pm.cut(params, x)
    sp = cut.split(params)
    costs = pm.measure_costs(params, x, y, mse)
    bw = pm.stage_times.as_dict(2)["bw"]
    print(f"2. Heavy second stage, mesh 1x2, m={m} x {mb} rows; measured (ms):")
    for p in range(2):
        print(
            f"    stage {p}: F {costs.f[p]:.3f}  B {costs.b[p]:.3f}  W {costs.w[p]:.3f}"
            f"  BW {bw[p]:.3f}  (B+W)/BW {(costs.b[p] + costs.w[p]) / bw[p]:.2f}"
            f"  F not split {costs.f_fused[p]:.3f}"
        )
    print(f"    C {costs.c:.3f}  tick {costs.tick:.3f}")
    from pjit_pipe.frontend.planning.measure import tick_seconds

    wide = pp.make_mesh(data=2, stage=4)
    boundary = jax.ShapeDtypeStruct((mb, model.width), jnp.float32)
    print(
        f"    an idle tick on the 2x4 mesh, same buffer: {1e3 * tick_seconds(wide, boundary):.3f} ms"
    )

    # The greedy keeps room for the rest of a worker's program when an op overtakes,
    # so a limit half a unit above the own peak can give a table that still peaks
    # at the own peak (printed as "peak").
    own = largest_peak(make_schedule("zb-h1", 2, m, costs=costs))
    packings = [
        ("own peak", costs, None),
        ("own peak, tick priced 0", dataclasses.replace(costs, tick=0.0), None),
        ("limit own peak + 1/2", costs, own + 0.5),
        ("unbounded", costs, math.inf),
    ]
    programs, tables, rows = {}, {}, []  # rows: (packing, kind, program name)
    # zb-h1 made with the measured costs runs a stage fused where its split buys no
    # time (passes.fuse_backward). "zb-h1 split": zb-h1 with every stage split (made
    # without costs). "1f1b split": 1f1b's order with each BW run as B then W
    # (passes.split_backward): what the split costs inside the program, apart from
    # zb-h1's order.
    extra = ("zb-h1 split", "1f1b split")
    for label, priced, limit in packings:
        for kind in ("1f1b", "zb-h1", *extra)[: 4 if label == "own peak" else 2]:
            sched = make_schedule(kind.split()[0], 2, m, costs=None if kind in extra else priced)
            if kind == "1f1b split":
                sched = split_backward(sched)
            table = pack_ticks(sched, priced, 1, limit)
            name = next((n for n, t in tables.items() if t == table), None)
            if name is None:
                name = f"{kind} #{len(tables)}"
                tables[name] = table
                step = lower(table, cut.stage_fns(), mse, mesh, sp, x, y)
                programs[name] = lambda step=step: step.value_and_grad(sp, x, y)
            rows.append((label, kind, name))
    # The zb-h1 own-peak table with IDLE empty ticks appended: what an idle tick
    # of the real tick body costs, against the measured `tick`.
    idle, zb = 256, next(n for lab, k, n in rows if lab == "own peak" and k == "zb-h1")
    padded = dataclasses.replace(tables[zb], ticks=tables[zb].ticks + ({},) * idle)
    step = lower(padded, cut.stage_fns(), mse, mesh, sp, x, y)
    programs["padded"] = lambda step=step: step.value_and_grad(sp, x, y)
    for f in programs.values():  # compile and warm up
        jax.block_until_ready(f())
        jax.block_until_ready(f())
    # Wall time, and the process's CPU time (all its threads): the work done, which
    # other processes' load on the shared cores disturbs far less than wall time.
    wall: dict[str, list[float]] = {n: [] for n in programs}
    cpu: dict[str, list[float]] = {n: [] for n in programs}
    order = list(programs)
    for r in range(pairs):
        for name in order if r % 2 == 0 else order[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(programs[name]())
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    print(f"    {pairs} rounds; median wall and CPU ms, the table's price (measured costs, ms):")
    for label, kind, name in rows:
        print(
            f"    {label:24s} {kind:11s} {len(tables[name]):3d} ticks"
            f"  wall {quartiles(wall[name])[1] * 1e3:8.2f}  CPU {quartiles(cpu[name])[1] * 1e3:8.2f}"
            f"  priced {packed_time(tables[name], costs):8.2f}"
            f"  peak {max(tables[name].peak_memory().values()):g}  ({tables[name].schedule.kind})"
        )
    for label, _, _ in packings:
        names = {kind: name for lab, kind, name in rows if lab == label}
        for clock, t in (("wall", wall), ("CPU", cpu)):
            for kind in ("zb-h1", *extra)[: len(names) - 1]:
                ratios = [z / o for z, o in zip(t[names[kind]], t[names["1f1b"]], strict=True)]
                q1, med, q3 = quartiles(ratios)
                target = " (target <= 1.05)" if kind == "zb-h1" else ""
                print(
                    f"    {kind} / 1f1b, {label:24s} {clock:4s} {med:.3f} [{q1:.3f}, {q3:.3f}]"
                    + target
                )
    extra = [(p - z) / idle for p, z in zip(wall["padded"], wall[zb], strict=True)]
    q1, med, q3 = quartiles(extra)
    print(
        f"    an idle tick of the real tick body (zb-h1 + {idle} empty ticks): {med * 1e3:.3f} ms"
        f" [{q1 * 1e3:.3f}, {q3 * 1e3:.3f}]; measured by costs='measure': {costs.tick:.3f} ms"
    )


def auto_vs_fixed(repeats: int, quick: bool) -> None:
    from pjit_pipe.ir.schedule import ScheduleError
    from pjit_pipe.schedules import KINDS

    D, P, m = 2, 4, 8
    config = GPTConfig.tiny()
    model = GPT(config)
    n = D * m * 2
    x = jax.random.randint(jax.random.key(0), (n, config.seq_len), 0, config.vocab)
    y = jnp.roll(x, -1, axis=1)
    mesh = pp.make_mesh(data=D, stage=P)
    params = model.init(jax.random.key(1), x)
    fs, notes = {}, {}
    kinds = ("1f1b", "zb-h1", "auto") if quick else KINDS
    for kind in kinds:
        chunks = 2 if kind in ("interleaved-1f1b", "zb-v") else 1
        try:
            pm = pp.pipeline(
                model, stages=P, microbatches=m, schedule=kind, mesh=mesh, chunks=chunks
            )
            vg = pm.value_and_grad(lm_loss)
            jax.block_until_ready(vg(params, x, y))
        except (ScheduleError, ValueError) as e:
            print(f"    {kind:18s} skipped: {e}")
            continue
        fs[kind] = lambda vg=vg: vg(params, x, y)
        if kind == "auto":
            notes[kind] = f"  measured costs {pm.costs}"
    med = median_times(fs, repeats)
    best = min(med.values())
    print(f"3. Tiny GPT, mesh {D}x{P}, m={m} x 2 sequences:")
    for kind, t in med.items():
        print(
            f"    {kind:18s} {t * 1e3:8.2f} ms   over the fastest {t / best:.2f}{notes.get(kind, '')}"
        )


def split_bytes(name: str, model: nn.Module, loss_fn, x: jax.Array, y: jax.Array, m: int) -> None:
    """Print part 4's per-stage byte ratios for `model` cut into 4 stages."""
    params = model.init(jax.random.key(2), x)
    cut = pp.pipeline(model, stages=4, microbatches=m, schedule="1f1b").cut(params, x)
    mb = lambda a: jax.ShapeDtypeStruct((a.shape[0] // m, *a.shape[1:]), a.dtype)  # noqa: E731
    args = (cut.stage_fns(), LossLayout(loss_fn).vector, cut.split(params), mb(x), mb(y))
    fused, split = StageVjp(*args), StageVjp(*args, split=range(1, 4))
    print(f"  {name}, {x.shape[0] // m} rows per microbatch:")
    for s in range(1, 4):
        base = fused.residual_bytes(s)["b"]
        got = split.residual_bytes(s)
        after_f = (got["b"] + got["w_operands"]) / base
        after_b = (got["w_operands"] + got["cotangents"]) / base
        print(
            f"    stage {s}: fused {base / 1024:7.1f} KiB   B-pool {got['b'] / base:.2f}"
            f"  W operands {got['w_operands'] / base:.2f}  cotangents {got['cotangents'] / base:.2f}"
            f"   held after F {after_f:.2f} (units: 1)  after B {after_b:.2f} (units: 0.5)"
        )


def compiled_stores() -> None:
    """Residual stores and temp bytes of the compiled 1f1b and zb-h1 programs of
    tests/test_lowering.py::test_memory_follows_the_schedule's model (P=4, m=16)."""

    from pjit_pipe.lowering import lower
    from pjit_pipe.schedules import make_schedule

    P, m, width, rows = 4, 16, 64, 512
    keys = iter(jax.random.split(jax.random.key(0), 4 * P))
    params = [{"w": [jax.random.normal(next(keys), (width, width)) / 8 for _ in range(4)]}]
    params *= P

    def dense_stack(p, a):
        for w in p["w"]:
            a = jnp.tanh(a @ w)
        return a

    x = jax.random.normal(jax.random.key(1), (m * rows, width))
    y = jnp.zeros((m * rows,), jnp.int32)

    def loss(out, y):
        return jnp.mean(out**2) + 0.0 * y.sum()

    mesh = pp.make_mesh(data=1, stage=P)
    print(f"  compiled, {P} stages of 4 tanh denses width {width}, m={m} x {rows} rows:")
    for kind in ("1f1b", "zb-h1"):
        step = lower(make_schedule(kind, P, m), [dense_stack] * P, loss, mesh, params, x, y)
        plan, st = step._low.plan, step._low.st
        w_pool = plan.res_slots * st.w_spec.total_bytes()
        b_pool = plan.bres_slots * st.b_spec.total_bytes()
        temp = step.memory_analysis().temp_size_in_bytes
        print(
            f"    {kind:6s} W-pool {plan.res_slots} slots {w_pool / 2**20:5.2f} MiB"
            f"  B-pool {plan.bres_slots} slots {b_pool / 2**20:5.2f} MiB"
            f"  compiled temp {temp / 2**20:6.2f} MiB"
        )


def memory(quick: bool) -> None:
    from pjit_pipe.models.mlp import ResidualMLP

    print("4. Bytes per microbatch of a split stage over the fused BW's residuals:")
    m = 8
    config = GPTConfig.tiny()
    x = jax.random.randint(jax.random.key(0), (m * 2, config.seq_len), 0, config.vocab)
    split_bytes("tiny GPT", GPT(config), lm_loss, x, jnp.roll(x, -1, axis=1), m)
    mlp = ResidualMLP(d_model=256, hidden=1024, n_layers=8, d_out=8)
    x = jax.random.normal(jax.random.key(0), (m * 64, 32))
    split_bytes("residual MLP d=256", mlp, mse, x, jnp.zeros((m * 64, 8)), m)
    compiled_stores()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer kinds")
    ap.add_argument(
        "--pairs", type=int, default=31, help="part 2: rounds of interleaved 1f1b/zb-h1 calls"
    )
    ap.add_argument("--part", type=int, choices=(1, 2, 3, 4), action="append")
    args = ap.parse_args(argv)
    parts = args.part or (1, 2, 3, 4)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    if 1 in parts:
        per_stage(args.repeats, args.quick)
    if 2 in parts:
        heavy_second_stage(args.pairs, args.quick)
    if 3 in parts:
        auto_vs_fixed(args.repeats, args.quick)
    if 4 in parts:
        memory(args.quick)


if __name__ == "__main__":
    main()
