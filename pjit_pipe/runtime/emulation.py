"""An emulated run of a compiled tick program: each op sleeps its price.

The lowering compiles the schedule's tick table as for a model, with every
op's compute replaced by a host callback (lowering/compute/emulated_ticks.py);
`SleepingHost` answers those callbacks. Each device replays its own share of
each tick as the price reads it (`simulator.tick_sync.WorkerTick`): an op
sleeps its cost x `unit` seconds, one that reads a late message first waits
until C into the tick, and the tick's end waits until C after its last op that
sends at once (the transfer). Nothing else waits: how long a device idles for
the others is up to the runtime's collectives, which are the real program's
ppermutes. So the measured period is what the runtime pays for the table,
the figure to hold against its prices (tick_sync.py).

`emulate_in_process` runs it on D*P devices of this process;
runtime/emulate_processes.py runs one process per device.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import AXES, KIND_CODES, LoweringOptions, lower
from pjit_pipe.simulator import PlannedOp, TickPricer, TickTimeline, WorkerTick

CODE_KINDS = {code: kind for kind, code in KIND_CODES.items()}
BACKWARD = (Kind.B, Kind.W, Kind.BW)
WIDTH = 4  # the emulated model's activation width: messages are this small


@dataclass
class _Device:
    """One device's place in its replay: its tick, when that tick started on the
    host clock, the ops of the tick not yet run, and when its last sending op ended."""

    tick: int = -1
    t0: float = 0.0
    left: list[PlannedOp] = field(default_factory=list)
    sent: float | None = None


class SleepingHost:
    """The host side of an emulated run (an `emulated_ticks.EmulationHost`).

    `shares[d]`: device d's `WorkerTick`s, tick by tick (d indexes the
    program's live workers); `unit`: seconds per cost unit; `c`: the transfer
    time in cost units. `records` collects (device, iteration, start, end) of
    every op run, in seconds of `time.perf_counter` (one clock for every
    process of a host)."""

    def __init__(self, shares: Sequence[Sequence[WorkerTick]], unit: float, c: float):
        self.shares, self.unit, self.c = shares, unit, c
        self.devices = {d: _Device() for d in range(len(shares))}
        self.records: list[tuple[int, int, float, float]] = []
        self.lock = threading.Lock()

    @classmethod
    def of(cls, table: PackedTicks, costs: Costs, unit: float) -> SleepingHost:
        """The host that replays `table` under `costs` (devices in the lowering's order)."""
        timeline = TickTimeline(TickPricer(table.schedule, costs), table)
        workers = table.schedule.alive_workers
        return cls([[shares[w] for shares in timeline.ticks] for w in workers], unit, costs.c)

    def start(self, device: Any, dep: Any) -> np.float32:
        state = self.devices[int(device)]
        state.tick += 1
        state.t0, state.sent = time.perf_counter(), None
        state.left = list(self.shares[int(device)][state.tick].ops)
        return np.float32(0)

    def run(self, device: Any, dep: Any, *, kind: int, stage: int) -> np.float32:
        d = int(device)
        state = self.devices[d]
        ops = self._take(state, CODE_KINDS[kind], stage, d)
        if any(p.reads_late for p in ops):
            _sleep_until(state.t0 + self._floor(d) * self.unit)
        begin = time.perf_counter()
        _sleep_until(begin + sum(p.duration for p in ops) * self.unit)
        end = time.perf_counter()
        if any(p.sends_now for p in ops):
            state.sent = end
        with self.lock:
            self.records.append((d, ops[0].iteration, begin, end))
        return np.float32(0)

    def end(self, device: Any, dep: Any) -> np.float32:
        d = int(device)
        state = self.devices[d]
        until = state.t0 + self._floor(d) * self.unit
        if state.sent is not None:
            until = max(until, state.sent + self.c * self.unit)
        _sleep_until(until)
        return np.float32(0)

    def _floor(self, d: int) -> float:
        return self.shares[d][self.devices[d].tick].floor

    def _take(self, state: _Device, kind, stage: int, d: int) -> list[PlannedOp]:
        """The planned ops one callback of (kind, stage) runs: one op, or a fused
        loss-stage group (its F and the backward ops of its microbatch)."""
        first = kind if kind in (Kind.F, Kind.B, Kind.W, Kind.BW) else Kind.F
        for i, p in enumerate(state.left):
            if p.op.kind is first and p.op.stage == stage:
                taken = [state.left.pop(i)]
                if first is not kind:  # a fused group
                    key = (p.iteration, p.op.mb, p.op.replica)
                    taken += [
                        q
                        for q in state.left
                        if q.op.kind in BACKWARD
                        and q.op.stage == stage
                        and (q.iteration, q.op.mb, q.op.replica) == key
                    ]
                    state.left = [q for q in state.left if q not in taken]
                return taken
        raise RuntimeError(
            f"emulated run: device {d} ran {kind} of stage {stage} in tick {state.tick}, "
            "which its table does not hold there"
        )

    def period(self) -> float:
        """The median period of the iterations after the first, in cost units."""
        return steady_period(self.records, self.unit)


def steady_period(records: Sequence[tuple[int, int, float, float]], unit: float) -> float:
    """Median over iterations k >= 1 of (end of k - end of k-1), each iteration's end
    the last end of its ops on any device, in units of `unit` seconds."""
    ends: dict[int, float] = {}
    for _, it, _, end in records:
        ends[it] = max(ends.get(it, end), end)
    order = [ends[k] for k in sorted(ends)]
    if len(order) < 2:
        raise ValueError("an emulated period needs at least 2 iterations")
    return statistics.median(b - a for a, b in itertools.pairwise(order)) / unit


def _sleep_until(t: float) -> None:
    left = t - time.perf_counter()
    if left > 0:
        time.sleep(left)


def emulated_step(table: PackedTicks, host: SleepingHost, mesh: Mesh, pairwise: bool):
    """(the compiled training step of `table`'s program with `host`'s callbacks, and
    its arguments): a model of WIDTH-wide stages whose compute is never run."""
    schedule = table.schedule
    S, n = schedule.num_virtual_stages, schedule.replicas * schedule.microbatches
    params = [{"w": np.ones((WIDTH,), np.float32)} for _ in range(S)]
    x = np.ones((n, WIDTH), np.float32)
    step = lower(
        table,
        [lambda p, a: a * p["w"]] * S,
        lambda out, y: jnp.mean((out - y) ** 2),
        mesh,
        params,
        x,
        x,
        LoweringOptions(optimizer=optax.sgd(0.0), pairwise=pairwise, emulate=host),
    )
    batch = np.ones((table.iterations, n, WIDTH), np.float32)
    return step, (params, step.init_opt_state(params), batch, batch)


def emulate_in_process(
    table: PackedTicks, costs: Costs, unit_ms: float, pairwise: bool = False
) -> float:
    """The measured steady period (cost units) of `table` run on D*P devices of this
    process, each op sleeping its cost x `unit_ms` milliseconds."""
    schedule = table.schedule
    D, P = schedule.replicas, schedule.stages
    devices = jax.devices()
    if len(devices) < D * P:
        raise ValueError(
            f"emulate: {D * P} devices needed in this process, {len(devices)} available; "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={D * P} before JAX starts"
        )
    grid = np.array(devices[: D * P], dtype=object).reshape(D, P)
    mesh = Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
    host = SleepingHost.of(table, costs, unit_ms / 1000)
    step, args = emulated_step(table, host, mesh, pairwise)
    jax.block_until_ready(step.train_step(*args))
    return host.period()
