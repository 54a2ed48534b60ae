"""Failure detection: which workers are down, and whether one died during a step.

A detector wraps each attempt at a training step (`with detector.attempt(step)
as down:`). It yields the workers that are down as the attempt starts (so the
runtime picks the program for them) and raises `WorkerFailure` when the block
exits if a worker of that program died meanwhile: the attempt's results must
then be thrown away and the step retried on the new variant.

Two sources share this interface: `InjectedFailures` (tests, the demo, the
CLI) and `LiveDevices`, which asks the distributed runtime
(`jax.experimental.multihost_utils.live_devices`) on a multi-process job
started with `initialize_distributed` (runtime/distributed.py): a process
that dies takes its devices' workers down, and the survivors' collective with
it fails after the collective timeout instead of hanging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

import jax
from jax.sharding import Mesh

from pjit_pipe.frontend import worker_devices
from pjit_pipe.ir.failures import check_failure_plan
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

    The failure detector of tests, the demo and the CLI: it plays a fixed plan
    through the same `attempt` interface as `LiveDevices`. Workers are
    (replica, stage) pairs.

    Args:
        fail: step -> workers that die *during* that step (its first attempt
            runs on the old program and is lost).
        rejoin: step -> workers that are back before that step starts.
        down: Workers already down at the start (a resumed run's, from its
            checkpoint).

    Attributes:
        fail: The `fail` plan, as step -> frozenset of Workers.
        rejoin: The `rejoin` plan, as step -> frozenset of Workers.
        down: The workers down now; updated as attempts run.
    """

    def __init__(
        self,
        fail: Mapping[int, Iterable[tuple[int, int]]] | None = None,
        rejoin: Mapping[int, Iterable[tuple[int, int]]] | None = None,
        down: Iterable[tuple[int, int]] = (),
    ):
        self.fail = {s: frozenset(Worker(*w) for w in ws) for s, ws in (fail or {}).items()}
        self.rejoin = {s: frozenset(Worker(*w) for w in ws) for s, ws in (rejoin or {}).items()}
        self.down: frozenset[Worker] = frozenset(Worker(*w) for w in down)
        self._failed_at: set[int] = set()
        self._rejoined_at: set[int] = set()

    def check(self, replicas: int, stages: int, start: int = 0) -> None:
        """Check that the plan can run on a replicas x stages mesh from step `start`.

        Called before anything compiles, so a bad plan fails at once (see
        `ir.failures.check_failure_plan` for the rules).

        Args:
            replicas: Data-parallel replicas D of the mesh.
            stages: Pipeline stages P of the mesh.
            start: The first step the run takes (a resumed run's is > 0).

        Raises:
            FailurePlanError: A worker lies outside the mesh, fails while
                already down or rejoins while not down, or every replica of a
                stage would be down at once. Events before `start` count as
                already happened.
        """
        as_pairs = lambda plan: {k: [tuple(w) for w in ws] for k, ws in plan.items()}  # noqa: E731
        check_failure_plan(
            as_pairs(self.fail), as_pairs(self.rejoin), replicas, stages, None, self.down, start
        )

    def planned(self) -> list[frozenset[Worker]]:
        """The sets of workers down that the plan goes through, from the workers
        down now, in the order it reaches them: the variants a run will need, so
        the runtime compiles them first.

        Returns:
            Each non-empty set once, in order of first occurrence.
        """
        order: list[frozenset[Worker]] = []

        def reach(down: frozenset[Worker]) -> None:
            if down and down not in order:
                order.append(down)

        down = self.down
        reach(down)
        for step in sorted({*self.fail, *self.rejoin}):
            down = down - self.rejoin.get(step, frozenset())  # back before the step
            reach(down)
            down = down | self.fail.get(step, frozenset())  # dead during it
            reach(down)
        return order

    @contextlib.contextmanager
    def attempt(self, step: int) -> Iterator[frozenset[Worker]]:
        """Context for one attempt at `step`, with the plan's rejoins and failures applied.

        Workers planned to rejoin at or before `step` are back as it starts;
        workers planned to fail at `step` die during its first attempt only, so
        the retry runs on the new variant.

        Args:
            step: The step being attempted.

        Yields:
            The workers down as the attempt starts.

        Raises:
            WorkerFailure: On exit, when workers were planned to die during
                this first attempt at `step`.
        """
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


COLLECTIVE_FAILURE = ("gloo", "collective", "timed out", "deadline_exceeded", "pair closure")


class CollectiveTimeout(WorkerFailure):
    """A collective of the step failed while every process stayed live: a peer
    reached it later than the collective timeout while its heartbeats went on
    (one process compiled the step's program that much later, say; a stopped
    process misses its heartbeats and counts as dead). Nothing is down, so the
    same program would run again over the same broken connections; the trainer
    stops."""

    def __init__(self, step: int, cause: BaseException):
        self.step = step
        self.workers = frozenset()
        first = next((line for line in str(cause).splitlines() if line.strip()), "")
        RuntimeError.__init__(
            self,
            f"step {step}: a collective failed with every process live ({first[:200]}); a "
            "peer was later than the collective timeout: raise collective_timeout_s of "
            "initialize_distributed above the longest stall, or restart from the last "
            "checkpoint",
        )


class LiveDevices:
    """Liveness from the distributed runtime (multi-process jobs).

    Each attempt runs inside `multihost_utils.live_devices`, whose exit is
    atomic across processes: either every live process finished the block or
    every one raises. The job must have been started with
    `initialize_distributed` (recoverability, a short heartbeat timeout and,
    on CPU, a collective timeout): then a survivor's collective with a dead
    peer fails after the collective timeout and the attempt raises
    `WorkerFailure` naming the dead process's workers. A process that holds
    no device of the mesh (the coordinator of `pjit-pipe train --processes`)
    takes no part.

    Args:
        mesh: The pipeline's ("data", "stage") mesh; its device at [r, s] is
            worker (r, s).

    Attributes:
        worker_of: Device -> the Worker it runs.
    """

    def __init__(self, mesh: Mesh):
        grid = worker_devices(mesh)  # a worker is down when any device of its group is
        self.worker_of = {
            d: Worker(r, s)
            for r in range(mesh.shape["data"])
            for s in range(mesh.shape["stage"])
            for d in grid[r, s]
        }

    def process_workers(self) -> dict[int, frozenset[Worker]]:
        """The workers each process runs: what goes down when it dies.

        Returns:
            {process index: its workers}, for the processes holding mesh devices.
        """
        out: dict[int, set[Worker]] = {}
        for device, worker in self.worker_of.items():
            out.setdefault(device.process_index, set()).add(worker)
        return {p: frozenset(ws) for p, ws in sorted(out.items())}

    def planned(self, process: int) -> list[frozenset[Worker]]:
        """The failure sets `process` may have to run next: each other process's
        workers down, for those whose death leaves every stage a replica.

        Args:
            process: The process asking (its own death needs no program of its).

        Returns:
            Those sets, in process order.
        """
        everyone = set(self.worker_of.values())
        stages = {w.stage for w in everyone}
        return [
            workers
            for p, workers in self.process_workers().items()
            if p != process and {w.stage for w in everyone - workers} == stages
        ]

    def sync(self) -> None:
        """Wait until every live process of the mesh is here (a barrier that skips
        dead processes): survivors that compiled a program at different speeds
        start it together, well within the collective timeout."""
        from jax._src import distributed

        processes = sorted({d.process_index for d in self.worker_of})
        distributed.global_state.client.get_live_nodes(processes)

    @contextlib.contextmanager
    def attempt(self, step: int) -> Iterator[frozenset[Worker]]:
        """Context for one attempt at `step`, inside `multihost_utils.live_devices`.

        Args:
            step: The step being attempted.

        Yields:
            The workers whose devices are not live as the attempt starts.

        Raises:
            WorkerFailure: On exit, when a process died during the attempt
                (naming the workers of its devices).
            CollectiveTimeout: A collective of the attempt failed while every
                process stayed live.
        """
        from jax.experimental import multihost_utils

        try:
            with multihost_utils.live_devices(list(self.worker_of)) as alive:
                yield frozenset(w for d, w in self.worker_of.items() if d not in set(alive))
        except multihost_utils.ProcessFailureError as e:
            raise WorkerFailure(step, (self.worker_of[d] for d in e.failed_devices)) from e
        except jax.errors.JaxRuntimeError as e:  # the step failed, yet nobody died
            if any(word in str(e).lower() for word in COLLECTIVE_FAILURE):
                raise CollectiveTimeout(step, e) from e
            raise
