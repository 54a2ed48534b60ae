"""Emulated runs of compiled tick programs, and the two prices they are held against.

The emulated program is the real lowering with each op's compute replaced by
a host callback that sleeps its price (runtime/emulation.py). In one process
the collectives meet in a rendezvous of every device, so the run should cost
the global lockstep price; with one process per device over gloo each
ppermute is a send/recv between its pair, so the run should cost the
neighbour-synchronous price of simulator/tick_sync.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pjit_pipe.ir.costs import Costs
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.lowering.comms.routes import without_cycles
from pjit_pipe.passes import stagger
from pjit_pipe.runtime.emulate_processes import emulate_processes
from pjit_pipe.runtime.emulation import emulate_in_process, steady_period
from pjit_pipe.schedules import KINDS, make_schedule, schedule_with_failures
from pjit_pipe.simulator.simulate import TickPricer, simulate
from pjit_pipe.simulator.tick_sync import TickTimeline
from pjit_pipe.tick_packing.packer import pack_ticks

ROOT = Path(__file__).resolve().parents[1]


def prices(table, costs):
    s, n = table.schedule, table.iterations
    run = lambda sync: simulate(s, costs, n, mode="lockstep", ticks=table, sync=sync)  # noqa: E731
    return run("global").steady_period, run("neighbor").steady_period


def test_emulated_1f1b_costs_its_runtimes_price():
    """1F1B at P=4 m=4 under uneven costs with a transfer time (a deferred table):
    in one process the run pays at least the global lockstep price, on one process
    per device at least the neighbour-synchronous one (every op sleeps its price).
    How close to the price each lands depends on the machine's load:
    `python -m benchmarks.bench_emulate` prints those ratios."""
    costs = Costs.parse("5,6,4,1")
    schedule = make_schedule("1f1b", 4, 4, costs=costs)
    unit_ms = 10.0  # the bounds hold for any unit: every op sleeps at least its price
    together = pack_ticks(schedule, costs, 3)
    apart = pack_ticks(schedule, costs, 3, sync="neighbor")
    lockstep, _ = prices(together, costs)
    _, neighbor = prices(apart, costs)
    measured = emulate_in_process(together, costs, unit_ms)
    assert measured >= 0.95 * lockstep, (measured, lockstep)
    measured = emulate_processes(apart, costs, unit_ms)
    assert measured >= 0.95 * neighbor, (measured, neighbor)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("auto", "async-1f1b")])
def test_neighbor_price_is_at_most_global_and_global_matches_the_pricer(kind):
    """The timeline's global lockstep is the TickPricer's price, and waiting only for
    the devices a device meets never costs more than waiting for all."""
    for text in ("1,1,1,0", "5,6,4,1"):
        costs = Costs.parse(text)
        schedule = make_schedule(kind, 4, 8, costs=costs, replicas=2)
        table = pack_ticks(schedule, costs, 2)
        pricer = TickPricer(schedule, costs)
        timeline = TickTimeline(pricer, table)
        glob = max(e.end for e in timeline.events("global"))
        assert glob == pytest.approx(pricer.time(table))
        assert max(e.end for e in timeline.events("neighbor")) <= glob + 1e-9


def test_rerouted_and_staggered_tables_are_priced_both_ways():
    """A re-routed zb-h1 (2x4, one failure: peers run its microbatches) and a
    staggered zb-h2, packed for neighbour-synchronous ticks: valid tables whose
    neighbour price is at most their global one, and at most what the table
    packed for global lockstep costs under the neighbour price."""
    costs = Costs.parse("1,2,1,0")
    rerouted = schedule_with_failures("zb-h1", 4, 4, 2, [(1, 2)], costs, time_limit=1.0)
    staggered = stagger(make_schedule("zb-h2", 4, 4, costs=costs))
    for schedule in (rerouted, staggered):
        near_table = pack_ticks(schedule, costs, 2, sync="neighbor")
        near_table.check()
        glob, near = prices(near_table, costs)
        assert near <= glob + 1e-9
        _, near_of_global = prices(pack_ticks(schedule, costs, 2), costs)
        assert near <= near_of_global + 1e-9


def test_a_pipeline_of_one_chain_meets_only_its_neighbours():
    """GPipe at unit costs, C = 0, P = 3, m = 1: each tick one device works and
    sends to the next, so meeting only neighbours saves nothing: both prices are
    the chain of its ops, (m + P - 1)(F + BW) = 3 F and 3 BW of 2."""
    costs = Costs.parse("1,1,1,0")
    schedule = make_schedule("gpipe", 3, 1, costs=costs)
    table = pack_ticks(schedule, costs, 1)
    glob, near = prices(table, costs)
    assert near == glob == 3 * 1 + 3 * 2


def test_packing_for_neighbours_pays_under_their_price():
    """1F1B at P=4 m=8: the table packed for neighbour-synchronous ticks reaches the
    event-driven period under that price; the lockstep table does not."""
    costs = Costs.parse("1,2,1,0")
    schedule = make_schedule("1f1b", 4, 8, costs=costs)
    event = simulate(schedule, costs, 2).steady_period
    _, near_of_lockstep = prices(pack_ticks(schedule, costs, 2), costs)
    _, near = prices(pack_ticks(schedule, costs, 2, sync="neighbor"), costs)
    assert near == pytest.approx(event)
    assert near_of_lockstep > 1.1 * event


def test_steady_period_is_the_median_after_the_first_iteration():
    records = [(0, 0, 0.0, 1.0), (1, 1, 1.0, 3.0), (0, 2, 3.0, 4.0), (1, 3, 4.0, 10.0)]
    # iteration ends 1, 3, 4, 10: periods 2, 1, 6 -> median 2, in units of 0.5 s
    assert steady_period(records, 0.5) == 4.0


def test_without_cycles_splits_each_ring_once():
    ring = ((0, 1), (1, 2), (2, 3), (3, 0))
    chain = ((4, 5),)
    routes = without_cycles([ring + chain])
    assert sorted(p for r in routes for p in r) == sorted(ring + chain)
    assert routes[-1] == ((3, 0),)
    assert all(not has_cycle(r) for r in routes)
    assert without_cycles([chain]) == [chain]


def has_cycle(pairs) -> bool:
    nxt = dict(pairs)
    for start in nxt:
        node, seen = start, set()
        while node in nxt and node not in seen:
            seen.add(node)
            node = nxt[node]
        if node == start:
            return True
    return False


def _permutes(hlo: str) -> list[list[tuple[int, int]]]:
    found = re.findall(r"collective-permute[^\n]*source_target_pairs=\{([^\n]*?)\}\}", hlo)
    return [[tuple(map(int, p)) for p in re.findall(r"(\d+),(\d+)", f + "}")] for f in found]


@pytest.mark.slow
def test_no_compiled_collective_permute_has_a_cycle():
    """Interleaved 1F1B on 4 devices sends its activations round a ring (position 3's
    chunk 0 feeds position 0's chunk 1): the compiled program carries that wrap
    edge, and no collective-permute in its HLO closes a cycle."""
    P, m = 4, 4
    schedule = make_schedule("interleaved-1f1b", P, m)
    S = schedule.num_virtual_stages
    params = [{"w": np.full((4,), 0.5, np.float32)} for _ in range(S)]
    x = np.ones((m, 4), np.float32)
    mesh = jax.make_mesh((1, P), ("data", "stage"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    step = lower(
        schedule,
        [lambda p, a: jnp.tanh(a * p["w"])] * S,
        lambda out, y: jnp.mean((out - y) ** 2),
        mesh,
        params,
        x,
        x,
        LoweringOptions(optimizer=optax.sgd(0.1)),
    )
    hlo = step._vg.lower(params, x, x).compile().as_text()
    permutes = _permutes(hlo)
    assert any((P - 1, 0) in pairs for pairs in permutes)  # the ring's wrap edge is sent
    assert all(not has_cycle(pairs) for pairs in permutes), permutes


def test_tick_sync_option_is_checked():
    """PipelineOptions(tick_sync=) takes the two syncs or None, and no polish with
    neighbour packing (polishing prices global lockstep)."""
    from pjit_pipe.errors import OptionError
    from pjit_pipe.frontend.options import PipelineOptions

    assert PipelineOptions(stages=2, microbatches=2, tick_sync="neighbor").tick_sync == "neighbor"
    with pytest.raises(OptionError, match="tick_sync"):
        PipelineOptions(stages=2, microbatches=2, tick_sync="lockstep")
    with pytest.raises(OptionError, match="pack_polish"):
        PipelineOptions(stages=2, microbatches=2, tick_sync="neighbor", pack_polish=1.0)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pjit_pipe", "emulate", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args, word",
    [
        (["1f1b", "-P", "4", "-m", "4", "--costs", "1,2,1,0", "--iterations", "1"], "--iterations"),
        (["1f1b", "-P", "4", "-m", "4", "--costs", "1,2,1,0", "--unit-ms", "0"], "--unit-ms"),
        (["1f1b", "-P", "4", "-m", "4", "--costs", "1,2"], "--costs"),
        (["1f1b", "-P", "4", "-m", "4"], "--costs"),
        (["1f1b", "-P", "4", "-m", "4", "--costs", "1,2,1,0", "--tick-cost", "-1"], "--tick-cost"),
        (["async-1f1b", "-P", "4", "-m", "4", "--costs", "1,2,1,0"], "asynchronous"),
    ],
)
def test_bad_values_get_one_line(args, word):
    done = _cli(*args)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tick_cost", [0.0, 0.5])
def test_cli_prints_the_three_prices_and_the_measured_period(tick_cost):
    done = _cli(
        "gpipe", "-P", "2", "-m", "2", "--costs", "1,1,1,0", "--iterations", "2",
        "--tick-cost", str(tick_cost), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["runtime"] == "in-process" and out["tick_cost"] == tick_cost
    # GPipe behind a barrier: (m + P - 1)(F + BW) = 3 x 3, whichever way ticks meet, plus
    # the tick cost once a tick in the tick-synchronous prices (nothing sleeps it)
    assert out["event_period"] == 9
    ticks = out["ticks"] / out["iterations"]
    assert out["lockstep_period"] == out["neighbor_period"] == 9 + tick_cost * ticks
    # Every tick sleeps its price, so no run can beat 9 units; how far above it a run
    # lands depends on the machine's load (benchmarks.bench_emulate prints that ratio).
    assert out["measured_period"] >= 9 * 0.95
