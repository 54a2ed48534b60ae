"""What the benchmarks share: timers, the unpipelined baseline, and a model or two.

No environment set-up here: a benchmark that runs on an accelerator imports this
without forcing the CPU backend (bench_gpu), the CPU ones set XLA_FLAGS first.
Run a benchmark as a module from the repository root: `python -m benchmarks.bench_x`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import pjit_pipe as pp
from pjit_pipe.compiler import ScheduleSpec, build_schedule
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import LANE_ORDERS, PackedTicks
from pjit_pipe.models.mlp import ResidualBlock
from pjit_pipe.schedules import KINDS, schedule_with_failures
from pjit_pipe.simulator import simulate
from pjit_pipe.tick_packing import pack_ticks


def round_times(
    programs: dict, rounds: int, clock: Callable[[], float] = time.perf_counter
) -> dict:
    """Time (`clock`: wall by default) of each call of each program over `rounds`
    rounds, after one warm-up call each; every other round runs them in reverse
    order, so drift in machine load hits all alike and per-round ratios pair calls
    made side by side. `time.process_time` (this process's CPU seconds, all its
    threads) is steadier on a CPU shared with other work."""
    for f in programs.values():
        jax.block_until_ready(f())
    times: dict = {k: [] for k in programs}
    order = list(programs)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            start = clock()
            jax.block_until_ready(programs[k]())
            times[k].append(clock() - start)
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of `values`."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def scan_accumulation(apply: Callable[[Any, Any], Any], loss_fn: Callable, m: int):
    """f(params, x, y) -> (mean loss, mean gradients) over m microbatches:
    jax.value_and_grad of `loss_fn(apply(params, xb), yb)` for each microbatch,
    summed by a jitted lax.scan."""

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


def median_times(fs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each callable, run round-robin so machine load hits all alike."""
    for f in fs.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in fs}
    for _ in range(repeats):
        for k, f in fs.items():
            t = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


class HeavySecond(nn.Module):
    """A light first stage (one dense), then 4 residual blocks after a boundary."""

    width: int = 256

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        x = pp.boundary(x)
        for _ in range(4):
            x = ResidualBlock(4 * self.width)(x)
        return nn.Dense(8)(x)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


# The lockstep grid: every kind at (P, m) sizes under COSTS, and re-routed zb-h1.

ITERATIONS = 4
COSTS = ("1,1,1,0", "1,2,1,0", "5,6,4,1")


def periods(
    schedule, costs: Costs, mem_limit: float | None = None, orders=LANE_ORDERS, polish=0.0
) -> tuple[float, float, float, PackedTicks]:
    """(event steady period, one-op-per-tick lockstep period, packed lockstep period, table);
    packed within `mem_limit` (None: the schedule's own peak, pack_ticks' default) in
    the cheaper of the lane `orders`, polished `polish` seconds per window (0: not)."""
    event = simulate(schedule, costs, ITERATIONS).steady_period
    before = simulate(schedule, costs, ITERATIONS, mode="lockstep").steady_period
    table = pack_ticks(schedule, costs, ITERATIONS, mem_limit, orders, polish)
    after = simulate(schedule, costs, ITERATIONS, mode="lockstep", ticks=table).steady_period
    return event, before, after, table


def kind_cases(sizes, with_async: bool) -> Iterator[tuple[str, Schedule, str]]:
    """(label, schedule, costs) of the grid's cases of every kind at each (P, m) of
    `sizes` under each of COSTS; async-1f1b's only `with_async` (its table keeps
    the stream order: not packed)."""
    for (P, m), costs_text in itertools.product(sizes, COSTS):
        for kind in KINDS:
            if kind == "async-1f1b" and not with_async:
                continue
            chunks = 2 if kind == "interleaved-1f1b" else None
            spec = ScheduleSpec(kind, P, m, chunks)
            sched = build_schedule(spec, Costs.parse(costs_text))
            yield f"{kind} P={P} m={m}", sched, costs_text


def rerouted_cases() -> Iterator[tuple[str, Schedule, str]]:
    """(label, schedule, costs) of the grid's re-routed cases: zb-h1 on a 4x4 mesh,
    m=8, with one and with two failed workers, under 1,2,1,0 and 5,6,4,1."""
    for failed in ([(1, 2)], [(1, 2), (2, 0)]):
        for costs_text in ("1,2,1,0", "5,6,4,1"):
            costs = Costs.parse(costs_text)
            sched = schedule_with_failures("zb-h1", 4, 8, 4, failed, costs, time_limit=2.0)
            yield f"zb-h1 4x4 m=8, {len(failed)} failed", sched, costs_text
