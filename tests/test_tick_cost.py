"""The fixed cost of a tick (`Costs.tick`): priced once per tick, it makes the packer
pack into fewer ticks; `pjit-pipe schedule --tick-cost`; its measurement."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest

import pjit_pipe as pp
from pjit_pipe.cli import main
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator.simulate import packed_time, simulate
from pjit_pipe.tick_packing.packer import pack_ticks

# A 1x2 pipeline with a nearly empty first stage, as in bench_backward.py's part 2.
F, B, W = (0.05, 1.0), (0.0, 1.1), (0.05, 0.9)


def ticks_price(table: PackedTicks, f, b, w, tick: float) -> float:
    """Sum over ticks of the busiest worker's op time, plus `tick` per tick (C = 0,
    one chunk), from the op kinds alone."""
    own = {
        Kind.F: f,
        Kind.B: b,
        Kind.W: w,
        Kind.BW: tuple(x + y for x, y in zip(b, w, strict=True)),
    }
    total = 0.0
    for t in table.ticks:
        busy = [sum(own[op.kind][op.stage] for _, op in es if op.kind in own) for es in t.values()]
        total += max(busy, default=0.0) + tick
    return total


@pytest.mark.parametrize(("kind", "mem_limit"), [("1f1b", math.inf), ("zb-h1", None)])
def test_a_priced_tick_packs_fewer_ticks_at_the_price_of_their_sum(kind, mem_limit) -> None:
    free, dear = Costs(F, B, W), Costs(F, B, W, tick=1.0)
    sched = make_schedule(kind, 2, 16, costs=free)
    loose = pack_ticks(sched, free, 1, mem_limit)
    tight = pack_ticks(sched, dear, 1, mem_limit)
    tight.check()
    assert len(tight) < len(loose)  # a case where the price per tick changes the table
    for table in (loose, tight):
        want = ticks_price(table, F, B, W, 1.0)
        assert packed_time(table, dear) == pytest.approx(want)
        events = simulate(sched, dear, mode="lockstep", ticks=table).events
        assert max(e.end for e in events) == pytest.approx(want)
        # tick = 0: the price of the same table is the sum of its tick lengths alone.
        assert packed_time(table, free) == pytest.approx(ticks_price(table, F, B, W, 0.0))
    assert packed_time(tight, dear) < packed_time(loose, dear)


def test_the_tick_cost_must_be_a_number_at_least_zero() -> None:
    sched = make_schedule("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="tick"):
        packed_time(PackedTicks.one_op_per_tick(sched), Costs(tick=-1.0))


def test_cli_tick_cost_reaches_lockstep_period(capsys) -> None:
    args = ["schedule", "1f1b", "-P", "2", "-m", "4", "--costs", "1,2,1", "--json"]
    runs = {}
    for tick in ("0", "0.5"):
        assert main([*args, "--tick-cost", tick]) == 0
        runs[tick] = json.loads(capsys.readouterr().out)
    assert runs["0"]["steady_period"] == runs["0.5"]["steady_period"]  # event mode: no ticks
    # The packed table of the priced run, priced independently over 4 iterations.
    costs = Costs(1, 2, 1, tick=0.5)
    table = pack_ticks(make_schedule("1f1b", 2, 4, costs=costs), costs, 4)
    want = simulate(table.schedule, costs, 4, mode="lockstep", ticks=table).steady_period
    assert runs["0.5"]["lockstep_period"] == pytest.approx(want)
    assert runs["0.5"]["lockstep_period"] > runs["0"]["lockstep_period"]
    for bad in ("-1", "nan", "inf", "x"):
        assert main([*args, "--tick-cost", bad]) != 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--tick-cost" in err


def test_an_idle_tick_is_measured_positive() -> None:
    from pjit_pipe.frontend.planning.measure import tick_seconds

    mesh = pp.make_mesh(data=1, stage=2)
    seconds = tick_seconds(mesh, jax.ShapeDtypeStruct((8, 16), jnp.float32), repeats=5, ticks=100)
    assert 0 < seconds < 0.1
