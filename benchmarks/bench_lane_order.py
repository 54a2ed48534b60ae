"""The lane order of a packed tick table, compiled: B, W, F against F, B, W in one run.

`pack_ticks` packs every greedy variant under both lane orders (ir/ticks.py)
and keeps the cheaper table. For each case this packs the schedule with the
pipeline's measured costs (`costs="measure"`'s figures; one case also with
the costs 1,2,1,0 of issue 11's grid, where the orders differ most), within
the schedule's own peak (the default), twice: as the compiler does (both orders)
and with F, B, W alone (the packing before B, W, F existed). Where the two
tables differ it compiles both and prints their ticks, priced time, residual
store rows (W-pool / B-pool), XLA's compiled temp memory, the median step
time over `--rounds` rounds of alternating calls and the median of the
per-round ratios.

Run: python -m benchmarks.bench_lane_order [--rounds N] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import statistics

import jax
import jax.numpy as jnp

import pjit_pipe as pp
from benchmarks.common import HeavySecond, mse, round_times
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ticks import FORWARD_FIRST
from pjit_pipe.lowering import lower
from pjit_pipe.models.gpt import GPT, GPTConfig, lm_loss
from pjit_pipe.models.mlp import ResidualMLP
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator.simulate import packed_time
from pjit_pipe.tick_packing.packer import pack_ticks


def _case(name, model, x, y, loss, D, P, m, kinds, rounds, given: str | None = None) -> None:
    """`given`: pack with these costs (the CLI's F,B,W,C text) instead of the measured."""
    mesh = pp.make_mesh(data=D, stage=P)
    params = model.init(jax.random.key(2), x)
    pm = pp.pipeline(model, stages=P, microbatches=m, schedule="1f1b", mesh=mesh)
    cut = pm.cut(params, x)
    sp = cut.split(params)
    if given is None:
        costs = pm.measure_costs(params, x, y, loss)
        print(f"  {name}, mesh {D}x{P}, m={m}; measured costs (ms), tick {costs.tick:.3f}:")
    else:
        costs = Costs.parse(given)
        print(f"  {name}, mesh {D}x{P}, m={m}; packed with costs {given} (priced in their units):")
    programs, notes = {}, {}
    for kind in kinds:
        sched = make_schedule(kind, P, m, replicas=D, costs=costs)
        tables = {
            "both orders": pack_ticks(sched, costs),
            "F, B, W only": pack_ticks(sched, costs, orders=(FORWARD_FIRST,)),
        }
        if tables["both orders"] == tables["F, B, W only"]:
            print(f"    {sched.kind}: the same table ({len(tables['both orders'])} ticks, F, B, W)")
            continue
        for label, table in tables.items():
            step = lower(table, cut.stage_fns(), loss, mesh, sp, x, y)
            programs[(kind, label)] = lambda step=step: step.value_and_grad(sp, x, y)
            plan = step._low.plan
            notes[(kind, label)] = (
                f"{', '.join(table.order)}: {len(table):3d} ticks, priced "
                f"{packed_time(table, costs):8.2f}, rows {plan.res_slots} / {plan.bres_slots}, "
                f"temp {step.memory_analysis().temp_size_in_bytes / 2**20:6.2f} MiB"
            )
    if not programs:
        return
    times = round_times(programs, rounds)
    for kind in dict.fromkeys(k for k, _ in programs):
        print(f"    {kind}, {rounds} rounds:")
        for label in ("F, B, W only", "both orders"):
            ms = statistics.median(times[(kind, label)]) * 1e3
            print(f"      {label:13s} {notes[(kind, label)]}, wall {ms:8.2f} ms")
        ratios = [
            a / b
            for a, b in zip(
                times[(kind, "both orders")], times[(kind, "F, B, W only")], strict=True
            )
        ]
        q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        print(f"      both orders / F, B, W only: {med:.3f} [{q1:.3f}, {q3:.3f}]")


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
    width = 64 if args.quick else 256
    mlp = ResidualMLP(d_model=width, hidden=4 * width, n_layers=8, d_out=8)
    xm = jax.random.normal(jax.random.key(3), (8 * mb, 32))
    ym = jax.random.normal(jax.random.key(4), (8 * mb, 8))
    _case("residual MLP, 8 blocks", mlp, xm, ym, mse, 1, 4, 8, ("zb-h1",), args.rounds)
    _case("residual MLP, 8 blocks", mlp, xm, ym, mse, 1, 4, 8, ("zb-h1",), args.rounds, "1,2,1,0")
    config = GPTConfig.tiny()
    tokens = jax.random.randint(jax.random.key(0), (2 * 8 * 2, config.seq_len), 0, config.vocab)
    targets = jnp.roll(tokens, -1, axis=1)
    _case("tiny GPT", GPT(config), tokens, targets, lm_loss, 2, 4, 8, ("zb-h1",), args.rounds)


if __name__ == "__main__":
    main()
