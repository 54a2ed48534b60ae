"""Failure detection: which workers are down, and whether one died during a step.

A detector wraps each attempt at a training step (`with detector.attempt(step)
as down:`). It yields the workers that are down as the attempt starts (so the
runtime picks the program for them) and raises `WorkerFailure` when the block
exits if a worker of that program died meanwhile: the attempt's results must
then be thrown away and the step retried on the new variant.

Two sources share this interface: `InjectedFailures` (tests, the demo, the
CLI) and `LiveDevices`, which asks the distributed runtime
(`jax.experimental.multihost_utils.live_devices`, multi-controller GPU jobs
with `jax_enable_recoverability`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from jax.sharding import Mesh

from pjit_pipe.frontend.mesh import worker_devices
from pjit_pipe.ir.ops import Worker


class WorkerFailure(RuntimeError):
    """Workers died during an attempt at a step; its results must not be committed."""

    def __init__(self, step: int, workers: Iterable[Worker]):
        self.step = step
        self.workers = frozenset(Worker(*w) for w in workers)
        names = ", ".join(str(w) for w in sorted(self.workers))
        super().__init__(f"step {step}: worker(s) {names} failed during the step")


class FailureDetector(Protocol):
    def attempt(self, step: int) -> contextlib.AbstractContextManager[frozenset[Worker]]:
        """Context for one attempt at `step`: yields the workers down as it starts;
        raises WorkerFailure on exit if a worker died during it."""
        ...


class InjectedFailures:
    """Failures and rejoins at given steps, as if the hardware did it.

    fail[step]: workers that die *during* that step (its first attempt runs on
    the old program and is lost); rejoin[step]: workers that are back before
    that step starts.
    """

    def __init__(
        self,
        fail: Mapping[int, Iterable[tuple[int, int]]] | None = None,
        rejoin: Mapping[int, Iterable[tuple[int, int]]] | None = None,
    ):
        self.fail = {s: frozenset(Worker(*w) for w in ws) for s, ws in (fail or {}).items()}
        self.rejoin = {s: frozenset(Worker(*w) for w in ws) for s, ws in (rejoin or {}).items()}
        self.down: frozenset[Worker] = frozenset()
        self._failed_at: set[int] = set()
        self._rejoined_at: set[int] = set()

    @contextlib.contextmanager
    def attempt(self, step: int) -> Iterator[frozenset[Worker]]:
        for s in sorted(self.rejoin):
            if s <= step and s not in self._rejoined_at:
                self._rejoined_at.add(s)
                self.down -= self.rejoin[s]
        yield self.down
        dying = self.fail.get(step, frozenset()) - self.down
        if step not in self._failed_at and dying:
            self._failed_at.add(step)
            self.down |= dying
            raise WorkerFailure(step, dying)


class LiveDevices:
    """Liveness from the distributed runtime (multi-controller jobs).

    Each attempt runs inside `multihost_utils.live_devices`, whose exit is
    atomic across processes: either every live process finished the block or
    every one raises. A restarted process is live again, so its worker
    rejoins at the next attempt. Needs `jax.distributed.initialize` and, on
    GPU, `jax_enable_recoverability`; on CPU a dead process hangs the others
    (docs/design.md section 5), so tests use InjectedFailures.
    """

    def __init__(self, mesh: Mesh):
        grid = worker_devices(mesh)  # a worker is down when any device of its group is
        self.worker_of = {
            d: Worker(r, s)
            for r in range(mesh.shape["data"])
            for s in range(mesh.shape["stage"])
            for d in grid[r, s]
        }

    @contextlib.contextmanager
    def attempt(self, step: int) -> Iterator[frozenset[Worker]]:
        from jax.experimental import multihost_utils

        try:
            with multihost_utils.live_devices(list(self.worker_of)) as alive:
                yield frozenset(w for d, w in self.worker_of.items() if d not in set(alive))
        except multihost_utils.ProcessFailureError as e:
            raise WorkerFailure(step, (self.worker_of[d] for d in e.failed_devices)) from e
