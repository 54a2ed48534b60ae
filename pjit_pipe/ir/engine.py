"""The execution engine of the IR: the one statement of what an op waits for, and a timed run.

Every evaluator and list scheduler of the package reads its dependency rules
from here, so none can disagree about what a schedule means: the validator and
the event simulator run `Engine.run`; `defer_w` replays with `Engine.deps`;
the fast per-replica evaluator (`schedules.timing`), the list schedulers
(`schedules.heuristic`, `passes.list_scheduler`) and the exact MILP's
precedence edges (`schedules.milp`) are built from `needs`, `consumers` and
`makes`; tests/test_engine.py checks that each times every op as `run` does. Memory is
stated once too, in `pjit_pipe.ir.memory` (`MEMORY_DELTA`).

Dependencies, for virtual stage s of microbatch (j, home replica r):
  F(s)    needs the activation of F(s-1)               (activations flow down)
  B/BW(s) needs its own F(s)'s activation and the input gradient of B/BW(s+1)
          (gradients flow up; the last stage differentiates its own loss)
  W(s)    needs the gradient of its own B(s)
  OPT(s)  needs every W/BW of stage s in the iteration, on all replicas
          (the data-parallel gradient reduction); an asynchronous OPT(s, j)
          needs only microbatch j's W/BW of stage s, on all replicas
A tensor that crosses workers arrives `latency` after it is produced; with
explicit SEND/RECV ops it arrives only through them. Unless the schedule is
staggered, no worker starts iteration k+1 before every OPT of iteration k.

In an asynchronous schedule (per-microbatch OPTs, PipeDream's 1F1B) iterations
overlap as one never-flushing stream (`stream_order`): on each worker the
leading forwards of iteration k+1 interleave with the trailing backward groups
(the ops after its last forward, cut after each OPT) of iteration k, one
forward after each group: the worker keeps as many microbatches in flight as
its warm-up does.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pjit_pipe.ir.ops import Kind, Op, Payload, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError

DurationFn = Callable[[Worker, Op], float]
LatencyFn = Callable[[Worker, Worker], float]

# The keys an op waits for. Each kind has its own number of fields, so keys of
# different kinds never compare equal (NamedTuples compare as tuples); the one
# pair, MicrobatchGrads and Received, holds ints where the other holds tuples.


class Tensor(NamedTuple):
    """The activation F(stage) outputs (ACT) or the input gradient B/BW(stage) outputs (GRAD)."""

    payload: Payload
    stage: int
    mb: int
    replica: int

    def __str__(self) -> str:
        op = "F" if self.payload is Payload.ACT else "B"
        return f"{op}{self.stage}.{self.mb}r{self.replica}"


class Message(NamedTuple):
    """A tensor a SEND on `src` has put on the link to `dest`."""

    tensor: Tensor
    src: Worker
    dest: Worker

    def __str__(self) -> str:
        t = self.tensor
        return f"SEND:{t.payload.value}:{t.stage}.{t.mb}r{t.replica}->{self.dest}"


class Received(NamedTuple):
    """A tensor a RECV has delivered on worker `at`."""

    tensor: Tensor
    at: Worker

    def __str__(self) -> str:
        t = self.tensor
        return f"RECV:{t.payload.value}:{t.stage}.{t.mb}r{t.replica} on {self.at}"


class StageGrads(NamedTuple):
    """Every W/BW of a stage in the iteration, on all replicas: what its OPT reduces."""

    stage: int

    def __str__(self) -> str:
        return f"all W of stage {self.stage}"


class MicrobatchGrads(NamedTuple):
    """Microbatch `mb`'s W/BW of a stage, on all replicas: what an asynchronous OPT reduces."""

    stage: int
    mb: int

    def __str__(self) -> str:
        return f"all W of stage {self.stage} microbatch {self.mb}"


class AllOpts(NamedTuple):
    """Every OPT of the iteration: the barrier before the next one when not staggered."""

    def __str__(self) -> str:
        return "every OPT of the previous iteration"


Key = Tensor | Message | Received | StageGrads | MicrobatchGrads | AllOpts
_ALL_OPTS = AllOpts()


# A key of one iteration of a back-to-back run: (iteration, key). A plain pair,
# not a NamedTuple: runs build one per dependency, and a tuple is 4x cheaper.
Stamped = tuple[int, Key]


def needs(kind: Kind, stage: int, last: int) -> tuple[tuple[Payload, int], ...]:
    """The tensors (payload, virtual stage) of its own microbatch that a compute op consumes.

    `last` is the last virtual stage. This is the dataflow rule every engine uses.
    """
    if kind is Kind.F:
        return ((Payload.ACT, stage - 1),) if stage > 0 else ()
    if kind in (Kind.B, Kind.BW):
        own = (Payload.ACT, stage)
        return (own, (Payload.GRAD, stage + 1)) if stage < last else (own,)
    if kind is Kind.W:
        return ((Payload.GRAD, stage),)
    raise ScheduleError(f"needs: {kind} is not a compute op")


def consumers(payload: Payload, stage: int, last: int) -> tuple[tuple[Kind, int], ...]:
    """The compute ops (kind, virtual stage) of the same microbatch that consume a tensor
    of `payload` made at `stage`: `needs`, inverted."""
    return tuple(
        (kind, s)
        for s in (stage - 1, stage, stage + 1)
        if 0 <= s <= last
        for kind in (Kind.F, Kind.B, Kind.W, Kind.BW)
        if (payload, stage) in needs(kind, s, last)
    )


def makes(kind: Kind) -> Payload | None:
    """The tensor of its own stage a compute op outputs (None: W, whose output is local)."""
    if kind is Kind.F:
        return Payload.ACT
    if kind in (Kind.B, Kind.BW):
        return Payload.GRAD
    return None


def stream_order(
    program: Sequence[Op], iterations: int, asynchronous: bool
) -> list[tuple[int, int]]:
    """(iteration, op index) in the order a worker runs `iterations` copies of `program`.

    Synchronous: one copy after another. Asynchronous: the leading forwards of
    copy k+1 interleave with the trailing backward groups of copy k (module docstring).
    """
    n = len(program)
    if not asynchronous or n == 0:
        return [(it, i) for it in range(iterations) for i in range(n)]
    forwards = [i for i, op in enumerate(program) if op.kind is Kind.F]
    lead = next((i for i, op in enumerate(program) if op.kind is not Kind.F), n)
    tail_start = forwards[-1] + 1 if forwards else 0
    groups: list[list[int]] = [[]]
    for i in range(tail_start, n):
        groups[-1].append(i)
        if program[i].kind is Kind.OPT and i < n - 1:
            groups.append([])
    middle = list(range(lead, tail_start))
    order = [(0, i) for i in range(lead)]
    for it in range(iterations):
        order += [(it, i) for i in middle]
        heads = list(range(lead)) if it + 1 < iterations else []
        for k in range(max(len(heads), len(groups))):
            if k < len(groups):
                order += [(it, i) for i in groups[k]]
            if k < len(heads):
                order.append((it + 1, heads[k]))
    return order


@dataclass(frozen=True)
class TimedOp:
    """One executed op: where, which iteration, and when."""

    worker: Worker
    index: int
    iteration: int
    op: Op
    start: float
    end: float


class DeadlockError(ScheduleError):
    """No worker can make progress, yet some ops have not run."""


class Engine:
    """The rules bound to one schedule's placement (computed once, reused per run)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.explicit_comm = schedule.has_comm()
        self.last = schedule.num_virtual_stages - 1
        self.producer: dict[Tensor, Worker] = {}
        self.asynchronous = schedule.asynchronous
        self.wcount: dict[int, int] = defaultdict(int)  # stage -> its W/BW ops
        self.mb_wcount: dict[tuple[int, int], int] = defaultdict(int)  # (stage, mb) -> W/BW ops
        self.num_opt = 0
        for w, _, op in schedule.ops():
            if op.kind is Kind.F:
                self.producer[Tensor(Payload.ACT, op.stage, op.mb, op.replica)] = w
            elif op.kind in (Kind.B, Kind.BW):
                self.producer[Tensor(Payload.GRAD, op.stage, op.mb, op.replica)] = w
            if op.kind in (Kind.W, Kind.BW):
                self.wcount[op.stage] += 1
                self.mb_wcount[(op.stage, op.mb)] += 1
            elif op.kind is Kind.OPT:
                self.num_opt += 1

    def _arrival(self, tensor: Tensor, w: Worker) -> tuple[Key, bool]:
        """(key to wait for, whether it crosses a link) for a tensor consumed on `w`."""
        src = self.producer.get(tensor)
        if src is None or src == w:
            return tensor, False
        if self.explicit_comm:
            return Received(tensor, w), False
        return tensor, True

    def deps(self, w: Worker, op: Op) -> list[tuple[Key, bool]]:
        """What `op` on worker `w` waits for: (key, arrives over a link)."""
        s, j, r = op.stage, op.mb, op.replica
        if op.kind is Kind.OPT:
            return [(StageGrads(s) if j < 0 else MicrobatchGrads(s, j), False)]
        if op.kind is Kind.SEND:
            return [(Tensor(op.payload, s, j, r), False)]
        if op.kind is Kind.RECV:
            return [(Message(Tensor(op.payload, s, j, r), op.peer, w), True)]
        out = []
        for payload, stage in needs(op.kind, s, self.last):
            tensor = Tensor(payload, stage, j, r)
            # An op's own-stage input is made on its own worker: it never crosses.
            out.append(self._arrival(tensor, w) if stage != s else (tensor, False))
        return out

    def produces(self, w: Worker, op: Op) -> list[Key]:
        s, j, r = op.stage, op.mb, op.replica
        if op.kind is Kind.F:
            return [Tensor(Payload.ACT, s, j, r)]
        if op.kind is Kind.B:
            return [Tensor(Payload.GRAD, s, j, r)]
        grads = [MicrobatchGrads(s, j)] if self.asynchronous else [StageGrads(s)]
        if op.kind is Kind.BW:
            return [Tensor(Payload.GRAD, s, j, r), *grads]
        if op.kind is Kind.W:
            return grads
        if op.kind is Kind.OPT:
            return [_ALL_OPTS]
        if op.kind is Kind.SEND:
            return [Message(Tensor(op.payload, s, j, r), w, op.peer)]
        return [Received(Tensor(op.payload, s, j, r), w)]

    def aggregate_size(self, key: Key) -> int:
        """How many producers an aggregate key needs (1 for plain keys)."""
        if isinstance(key, StageGrads):
            return self.wcount[key.stage]
        if isinstance(key, MicrobatchGrads):
            return self.mb_wcount[(key.stage, key.mb)]
        if isinstance(key, AllOpts):
            return self.num_opt
        return 1

    def barrier(self, iteration: int, index: int) -> Stamped | None:
        """The iteration barrier the op at `index` of a program waits for, if any."""
        if index == 0 and iteration > 0 and not self.schedule.staggered:
            return (iteration - 1, _ALL_OPTS)
        return None

    def run(self, duration: DurationFn, latency: LatencyFn, iterations: int = 1) -> list[TimedOp]:
        """Execute `iterations` back-to-back iterations; raise DeadlockError if stuck.

        Every op starts as soon as its worker is free and its inputs have arrived.
        """
        sched = self.schedule
        staggered = sched.staggered
        progs = {w: sched.program(w) for w in sched.alive_workers}
        deps = {w: [self.deps(w, op) for op in ops] for w, ops in progs.items()}
        prods = {  # (key, how many producers it needs) per op
            w: [[(k, self.aggregate_size(k)) for k in self.produces(w, op)] for op in ops]
            for w, ops in progs.items()
        }
        order = {w: stream_order(ops, iterations, self.asynchronous) for w, ops in progs.items()}
        ptr = dict.fromkeys(progs, 0)
        free = dict.fromkeys(progs, 0.0)
        resolved: dict[Stamped, tuple[float, Worker]] = {}
        partial: dict[Stamped, list] = {}
        waiting: dict[Stamped, list[Worker]] = defaultdict(list)
        events: list[TimedOp] = []
        queue = deque(progs)
        blocked_on: dict[Worker, Stamped] = {}

        def resolve(key: Stamped, need: int, t: float, w: Worker) -> None:
            if need > 1:
                acc = partial.setdefault(key, [0, 0.0])
                acc[0] += 1
                acc[1] = max(acc[1], t)
                if acc[0] < need:
                    return
                t = acc[1]
            resolved[key] = (t, w)
            queue.extend(waiting.pop(key, ()))

        while queue:
            w = queue.popleft()
            ops = progs[w]
            n = len(ops)
            while ptr[w] < n * iterations:
                it, idx = order[w][ptr[w]]
                op = ops[idx]
                start = free[w]
                wait_keys = [((it, k), cross) for k, cross in deps[w][idx]]
                if idx == 0 and it > 0 and not staggered:  # `barrier`, inlined: a hot loop
                    wait_keys.append(((it - 1, _ALL_OPTS), False))
                blocked = None
                for key, cross in wait_keys:
                    got = resolved.get(key)
                    if got is None:
                        blocked = key
                        break
                    t, src = got
                    start = max(start, t + (latency(src, w) if cross else 0.0))
                if blocked is not None:
                    waiting[blocked].append(w)
                    blocked_on[w] = blocked
                    break
                blocked_on.pop(w, None)
                end = start + duration(w, op)
                events.append(TimedOp(w, idx, it, op, start, end))
                free[w] = end
                ptr[w] += 1
                for k, need in prods[w][idx]:
                    resolve((it, k), need, end, w)

        stuck = [w for w in progs if ptr[w] < len(progs[w]) * iterations]
        if stuck:
            lines = []
            for w in stuck[:8]:
                it, idx = order[w][ptr[w]]
                lines.append(f"worker {w} op #{idx} {progs[w][idx]} waits for {blocked_on[w][1]}")
            raise DeadlockError("deadlock: " + "; ".join(lines))
        return events
