"""The schedule: one op program per worker, plus the placement it runs on."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pjit_pipe.errors import ScheduleError  # noqa: F401  (ir modules import it from here)
from pjit_pipe.ir.ops import COMM_KINDS, Kind, Op, Worker


def interleaved_layout(stages: int, chunks: int) -> tuple[int, ...]:
    """Virtual stage s lives on pipeline position s mod P (Megatron's interleaving)."""
    return tuple(s % stages for s in range(stages * chunks))


def v_layout(stages: int) -> tuple[int, ...]:
    """Two chunks per position in a V: position p holds stages p and 2P-1-p."""
    return tuple(list(range(stages)) + list(reversed(range(stages))))


@dataclass(frozen=True)
class Schedule:
    """Per-worker op programs for one training iteration.

    The IR every layer shares: generators and searches build it, passes rewrite
    it, the simulator prices it and the lowering compiles it. It is frozen;
    `replace` makes changed copies.

    Attributes:
        stages: P, the pipeline positions (devices) of one replica.
        chunks: v, virtual stages per position; there are P*v virtual stages.
        microbatches: m per replica per iteration.
        replicas: D data-parallel copies of the pipeline.
        layout: Virtual stage -> pipeline position that holds its parameters.
        programs: Worker -> its ops in execution order. A failed worker has none.
        failed: Workers that are down; their (replica, stage) work runs on peers.
        staggered: Each stage may start iteration k+1 right after its own OPT
            of iteration k; otherwise all workers meet at an iteration barrier.
        kind: The generator or pass chain that made it (informational).
    """

    stages: int
    chunks: int
    microbatches: int
    replicas: int
    layout: tuple[int, ...]
    programs: Mapping[Worker, tuple[Op, ...]]
    failed: frozenset[Worker] = frozenset()
    staggered: bool = False
    kind: str = "custom"
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_virtual_stages(self) -> int:
        """How many virtual stages the model is cut into.

        Returns:
            P*v: stages times chunks.
        """
        return self.stages * self.chunks

    @property
    def workers(self) -> list[Worker]:
        """Every worker of the D x P mesh, failed or not.

        Returns:
            The workers in (replica, stage) order.
        """
        return [Worker(r, p) for r in range(self.replicas) for p in range(self.stages)]

    @property
    def alive_workers(self) -> list[Worker]:
        """The workers that are not down.

        Returns:
            `workers` without `failed`, in (replica, stage) order.
        """
        return [w for w in self.workers if w not in self.failed]

    def program(self, worker: Worker) -> tuple[Op, ...]:
        """The ops one worker runs.

        Args:
            worker: A (replica, stage) worker.

        Returns:
            Its ops in execution order; empty for a failed worker.
        """
        return self.programs.get(worker, ())

    def held_stages(self, position: int) -> list[int]:
        """Virtual stages whose parameters live on one pipeline position.

        Args:
            position: A pipeline position, 0 <= position < stages.

        Returns:
            Those virtual stages, in increasing order.
        """
        return [s for s, p in enumerate(self.layout) if p == position]

    def chunk_of(self, stage: int) -> int:
        """Where a virtual stage is among the chunks its position holds.

        Args:
            stage: A virtual stage, 0 <= stage < num_virtual_stages.

        Returns:
            Its index in `held_stages` of its position.
        """
        return self.held_stages(self.layout[stage]).index(stage)

    def ops(self) -> Iterator[tuple[Worker, int, Op]]:
        """Every op of every worker.

        Yields:
            (worker, position in its program, op) triples, worker by worker in
            (replica, stage) order.
        """
        for w in self.workers:
            for i, op in enumerate(self.program(w)):
                yield w, i, op

    @functools.cached_property  # a scan of every op; the schedule is frozen
    def asynchronous(self) -> bool:
        """Whether OPTs step per microbatch (asynchronous 1F1B).

        Then no iteration boundary is a flush; see
        `pjit_pipe.ir.engine.stream_order` for how iterations overlap. Computed
        once (a scan of every op; the schedule is frozen).

        Returns:
            True when some OPT belongs to a microbatch.
        """
        return any(op.kind is Kind.OPT and op.mb >= 0 for _, _, op in self.ops())

    def has_comm(self) -> bool:
        """Whether explicit communication ops have been inserted.

        Returns:
            True when some op is a send or receive (one of COMM_KINDS).
        """
        return any(op.kind in COMM_KINDS for _, _, op in self.ops())

    def where(self, op: Op) -> Worker | None:
        """The worker whose program holds `op`.

        Compute ops and OPT are unique per worker; the index is built on the
        first call.

        Args:
            op: An op of this schedule.

        Returns:
            The first worker whose program holds it, or None when none does.
        """
        if self._index is None:
            index: dict[Op, Worker] = {}
            for w, _, o in self.ops():
                index.setdefault(o, w)
            object.__setattr__(self, "_index", index)
        return self._index.get(op)

    def replace(self, **changes) -> Schedule:
        """A copy with some fields changed.

        Args:
            **changes: Field name -> new value; programs are re-frozen to tuples.

        Returns:
            The new Schedule.
        """
        if "programs" in changes:
            changes["programs"] = {w: tuple(p) for w, p in changes["programs"].items()}
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        object.__setattr__(self, "programs", {w: tuple(p) for w, p in self.programs.items()})
        object.__setattr__(self, "failed", frozenset(Worker(*w) for w in self.failed))
        object.__setattr__(self, "layout", tuple(self.layout))
