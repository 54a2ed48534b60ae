"""Slow-worker detection: which workers run slower, at a quantized factor, without stopping training.

Inside one SPMD program every device waits at the same collectives, so a
step's time says that something is slow, not what. The detector therefore
times a fixed probe on each worker's device alone, every `every` steps,
between steps (`device_probe`: a small jitted matmul, a few milliseconds a
device): a worker whose probe takes `ratio` times the median probe runs at
that factor. Per-process step times would say the same under
multi-controller, but not in one process, and a probe needs no change to
the compiled program.

Factors are quantized (`FACTORS`: 1, 1.5, 2, 3, 4), so a pattern has few
variants to compile, and a change takes `confirm` probes in a row at the
same quantized factor (a worker slowed or back to full speed), so noise does
not switch programs back and forth.

Two monitors share one interface, `observe(step) -> {Worker: factor}`: the
`SlowDetector` over a probe, and `InjectedSlowdowns`, a fixed plan for tests,
the demo and `pjit-pipe train --slow` (the factor alone: on CPU the virtual
devices share the host, so a probe cannot tell them apart).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjit_pipe.frontend import worker_devices
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.slow import check_factor

FACTORS = (1.0, 1.5, 2.0, 3.0, 4.0)  # the factors a slow worker is marked at
Speeds = dict[Worker, float]  # slow workers' factors; absent workers run at 1


class SpeedMonitor(Protocol):
    def observe(self, step: int) -> Speeds:
        """The slow workers and their factors to run `step` with."""
        ...


def quantize(ratio: float, factors: tuple[float, ...] = FACTORS) -> float:
    """The factor of `factors` nearest to `ratio` on a log scale (1.2 -> 1, 1.8 -> 2).

    Args:
        ratio: A measured slowdown (probe time over the median).
        factors: The allowed factors, ascending, the first 1.

    Returns:
        One of `factors`.
    """
    return min(factors, key=lambda f: abs(np.log(max(ratio, 1e-9)) - np.log(f)))


class SlowDetector:
    """Slow workers from a per-device probe every `every` steps (module docstring).

    Args:
        probe: () -> {Worker: seconds}, one timing per live worker.
        every: Probe before every `every`-th step.
        confirm: Probes in a row at one quantized factor before a worker's
            factor changes.
        factors: The quantized factors (FACTORS).

    Attributes:
        speeds: The slow workers and their confirmed factors.
    """

    def __init__(
        self,
        probe: Callable[[], Mapping[Worker, float]],
        every: int = 10,
        confirm: int = 2,
        factors: tuple[float, ...] = FACTORS,
    ):
        self.probe, self.every, self.confirm, self.factors = probe, every, confirm, factors
        self.speeds: Speeds = {}
        self._seen: dict[Worker, tuple[float, int]] = {}  # last quantized factor, times in a row

    def observe(self, step: int) -> Speeds:
        """Probe when `step` is a multiple of `every`; the confirmed slow workers.

        Args:
            step: The step about to run.

        Returns:
            {Worker: factor > 1} of the workers confirmed slow.
        """
        if step % self.every == 0:
            self.update(self.probe())
        return dict(self.speeds)

    def update(self, seconds: Mapping[Worker, float]) -> Speeds:
        """Take one probe's timings into account.

        Args:
            seconds: {Worker: probe seconds}.

        Returns:
            The confirmed slow workers after it.
        """
        median = statistics.median(seconds.values())
        for worker, t in seconds.items():
            factor = quantize(t / median, self.factors) if median > 0 else 1.0
            last, times = self._seen.get(worker, (1.0, 0))
            self._seen[worker] = (factor, times + 1 if factor == last else 1)
            if self._seen[worker][1] >= self.confirm:
                if factor > 1.0:
                    self.speeds[worker] = factor
                else:
                    self.speeds.pop(worker, None)
        return dict(self.speeds)


def device_probe(mesh: Mesh, size: int = 256, repeats: int = 3) -> Callable[[], Speeds]:
    """A probe for `SlowDetector`: the best of `repeats` timings of a size x size
    matmul on each worker's first device, one device at a time.

    Args:
        mesh: The pipeline's (data, stage[, tensor]) mesh.
        size: The matmul's side.
        repeats: Timings per device; the least counts (noise only adds).

    Returns:
        () -> {Worker: seconds}.
    """
    grid = worker_devices(mesh)
    matmul = jax.jit(lambda a: a @ a)

    def probe() -> Speeds:
        out: Speeds = {}
        for r in range(grid.shape[0]):
            for s in range(grid.shape[1]):
                a = jax.device_put(jnp.ones((size, size), jnp.float32), grid[r, s, 0])
                jax.block_until_ready(matmul(a))  # compiled for this device
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    jax.block_until_ready(matmul(a))
                    best = min(best, time.perf_counter() - start)
                out[Worker(r, s)] = best
        return out

    return probe


class InjectedSlowdowns:
    """Slowdowns at given steps, as if the hardware did it: from step k on, worker
    (r, s) runs at the factor given (1: it has recovered).

    Args:
        plan: {step: {(replica, stage): factor >= 1}}.

    Raises:
        FailurePlanError: A factor that is not a finite number >= 1.
    """

    def __init__(self, plan: Mapping[int, Mapping[tuple[int, int], float]] | None = None):
        self.plan = {
            int(step): {
                Worker(*w): check_factor(f, f"worker {w[0]}:{w[1]}", "--slow")
                for w, f in changes.items()
            }
            for step, changes in (plan or {}).items()
        }

    def planned(self) -> list[Speeds]:
        """The sets of slow workers the plan goes through, in the order it reaches
        them: the variants a run will need, so the runtime compiles them first.

        Returns:
            Each non-empty {Worker: factor > 1} once, in order of first occurrence.
        """
        order: list[Speeds] = []
        for step in sorted(self.plan):
            speeds = self.observe(step)
            if speeds and speeds not in order:
                order.append(speeds)
        return order

    def observe(self, step: int) -> Speeds:
        """The slow workers in effect at `step`: every change at or before it applied.

        Args:
            step: The step about to run.

        Returns:
            {Worker: factor > 1}.
        """
        speeds: Speeds = {}
        for at in sorted(k for k in self.plan if k <= step):
            speeds.update(self.plan[at])
        return {w: f for w, f in speeds.items() if f > 1.0}
