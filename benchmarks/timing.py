"""Timers the benchmarks share. No environment set-up here: a benchmark that runs on
an accelerator imports this without forcing the CPU backend (bench_lowering does)."""

from __future__ import annotations

import statistics
import time

import jax


def round_times(programs: dict, rounds: int) -> dict:
    """Wall time of each call of each program over `rounds` rounds, after one
    warm-up call each; every other round runs them in reverse order, so drift in
    machine load hits all alike and per-round ratios pair calls made side by side."""
    for f in programs.values():
        jax.block_until_ready(f())
    times: dict = {k: [] for k in programs}
    order = list(programs)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            jax.block_until_ready(programs[k]())
            times[k].append(time.perf_counter() - start)
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of `values`."""
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3
