"""Dataflow semantics of the IR: which op waits for which, and a timed execution.

Every worker runs its program in order; an op starts when its worker is free
and every tensor it needs has arrived. This one engine is used by the
validator (to find deadlocks) and by the simulator (to price a schedule), so
the two can never disagree about what a schedule means.

Dependencies, for stage s of microbatch (j, home replica r):
  F(s)    needs the output of F(s-1)            (activations flow down)
  B/BW(s) needs F(s) and the input gradient of B/BW(s+1) (gradients flow up;
          the last stage needs only its F, whose loss it differentiates)
  W(s)    needs B(s)
  OPT(s)  needs every W/BW of stage s in the iteration, on all replicas
          (the data-parallel gradient reduction); an asynchronous OPT(s, j)
          needs only microbatch j's W/BW of stage s, on all replicas
A tensor that crosses workers arrives `latency` after it is produced; with
explicit SEND/RECV ops it arrives only through them. Unless the schedule is
staggered, no worker starts iteration k+1 before every OPT of iteration k.

In an asynchronous schedule (per-microbatch OPTs, PipeDream's 1F1B) iterations
overlap as one never-flushing stream: on each worker the leading forwards of
iteration k+1 interleave with the trailing backward groups (the ops after its
last forward, cut after each OPT) of iteration k, one forward after each group:
the worker keeps as many microbatches in flight as its warm-up does.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from pjit_pipe.ir.ops import Kind, Op, Payload, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError

Key = tuple
DurationFn = Callable[[Worker, Op], float]
LatencyFn = Callable[[Worker, Worker], float]


class DeadlockError(ScheduleError):
    """No worker can make progress, yet some ops have not run."""


@dataclass(frozen=True)
class Event:
    """One executed op: where, which iteration, and when."""

    worker: Worker
    index: int
    iteration: int
    op: Op
    start: float
    end: float


def _describe(key: Key) -> str:
    tag, *rest = key
    if tag in ("act", "grad"):
        s, j, r = rest
        return f"{'F' if tag == 'act' else 'B'}{s}.{j}r{r}"
    if tag == "wdone":
        return f"all W of stage {rest[0]}" + (f" microbatch {rest[1]}" if len(rest) > 1 else "")
    if tag == "opt_all":
        return "every OPT of the previous iteration"
    if tag == "msg":
        payload, s, j, r, dest = rest
        return f"SEND:{payload.value}:{s}.{j}r{r}->{dest}"
    payload, s, j, r, w = rest
    return f"RECV:{payload.value}:{s}.{j}r{r} on {w}"


def stream_order(
    program: tuple[Op, ...], iterations: int, asynchronous: bool
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


class Dataflow:
    """Static dependency structure of one schedule (computed once, reused per run)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.explicit_comm = schedule.has_comm()
        self.producer: dict[Key, Worker] = {}
        self.wcount: dict[tuple, int] = defaultdict(int)  # (stage,) or (stage, mb) -> W count
        self.num_opt = 0
        for w, _, op in schedule.ops():
            if op.kind is Kind.F:
                self.producer[("act", op.stage, op.mb, op.replica)] = w
            elif op.kind in (Kind.B, Kind.BW):
                self.producer[("grad", op.stage, op.mb, op.replica)] = w
            if op.kind in (Kind.W, Kind.BW):
                self.wcount[(op.stage,)] += 1
                self.wcount[(op.stage, op.mb)] += 1
            elif op.kind is Kind.OPT:
                self.num_opt += 1

    def _tensor_dep(self, key: Key, w: Worker) -> tuple[Key, bool]:
        """(key to wait for, whether it crosses workers) for a tensor consumed on `w`."""
        src = self.producer.get(key)
        if src is None or src == w:
            return key, False
        if self.explicit_comm:
            payload = Payload.ACT if key[0] == "act" else Payload.GRAD
            return ("recv", payload, *key[1:], w), False
        return key, True

    def deps(self, w: Worker, op: Op) -> list[tuple[Key, bool]]:
        """What `op` on worker `w` waits for: (key, arrives over a link)."""
        s, j, r = op.stage, op.mb, op.replica
        last = self.schedule.num_virtual_stages - 1
        if op.kind is Kind.F:
            return [self._tensor_dep(("act", s - 1, j, r), w)] if s > 0 else []
        if op.kind in (Kind.B, Kind.BW):
            out = [(("act", s, j, r), False)]
            if s < last:
                out.append(self._tensor_dep(("grad", s + 1, j, r), w))
            return out
        if op.kind is Kind.W:
            return [(("grad", s, j, r), False)]
        if op.kind is Kind.OPT:
            return [(("wdone", s) if j < 0 else ("wdone", s, j), False)]
        if op.kind is Kind.SEND:
            return [(("act" if op.payload is Payload.ACT else "grad", s, j, r), False)]
        return [(("msg", op.payload, s, j, r, w), True)]  # RECV

    @staticmethod
    def produces(w: Worker, op: Op) -> list[Key]:
        s, j, r = op.stage, op.mb, op.replica
        if op.kind is Kind.F:
            return [("act", s, j, r)]
        if op.kind is Kind.B:
            return [("grad", s, j, r)]
        if op.kind is Kind.BW:
            return [("grad", s, j, r), ("wdone", s), ("wdone", s, j)]
        if op.kind is Kind.W:
            return [("wdone", s), ("wdone", s, j)]
        if op.kind is Kind.OPT:
            return [("opt_all",)]
        if op.kind is Kind.SEND:
            return [("msg", op.payload, s, j, r, op.peer)]
        return [("recv", op.payload, s, j, r, w)]

    def aggregate_size(self, key: Key) -> int:
        """How many producers an aggregate key needs (1 for plain keys)."""
        if key[0] == "wdone":
            return self.wcount[key[1:]]
        if key[0] == "opt_all":
            return self.num_opt
        return 1

    def run(
        self,
        duration: DurationFn,
        latency: LatencyFn,
        iterations: int = 1,
    ) -> list[Event]:
        """Execute `iterations` back-to-back iterations; raise DeadlockError if stuck."""
        sched = self.schedule
        progs = {w: sched.program(w) for w in sched.alive_workers}
        deps = {w: [self.deps(w, op) for op in ops] for w, ops in progs.items()}
        prods = {w: [self.produces(w, op) for op in ops] for w, ops in progs.items()}
        order = {w: stream_order(ops, iterations, sched.asynchronous) for w, ops in progs.items()}
        ptr = dict.fromkeys(progs, 0)
        free = dict.fromkeys(progs, 0.0)
        resolved: dict[tuple, tuple[float, Worker]] = {}
        partial: dict[tuple, list] = {}
        waiting: dict[tuple, list[Worker]] = defaultdict(list)
        events: list[Event] = []
        queue = deque(progs)
        blocked_on: dict[Worker, tuple] = {}

        def resolve(key: tuple, t: float, w: Worker) -> None:
            need = self.aggregate_size(key[1:])
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
                wait_keys = [((it, *k), cross) for k, cross in deps[w][idx]]
                if idx == 0 and it > 0 and not sched.staggered:
                    wait_keys.append(((it - 1, "opt_all"), False))
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
                events.append(Event(w, idx, it, op, start, end))
                free[w] = end
                ptr[w] += 1
                for k in prods[w][idx]:
                    resolve((it, *k), end, w)

        stuck = [w for w in progs if ptr[w] < len(progs[w]) * iterations]
        if stuck:
            lines = []
            for w in stuck[:8]:
                it, idx = order[w][ptr[w]]
                key = blocked_on[w]
                lines.append(f"worker {w} op #{idx} {progs[w][idx]} waits for {_describe(key[1:])}")
            raise DeadlockError("deadlock: " + "; ".join(lines))
        return events
