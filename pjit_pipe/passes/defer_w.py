"""W deferral: move weight-gradient ops (W) later, into the idle gaps of their worker.

B is on the critical path (the previous stage waits for its input gradient), W
is not: it only has to finish before its stage's OPT. The pass replays the
schedule in time with the execution engine's rules (`pjit_pipe.ir.engine`), keeping the order of
every other op, and runs a pending W only when the worker would otherwise sit
idle. A W is forced earlier when its stage's OPT comes next, or when the next F
would push the worker's activation memory over `mem_limit` (W frees memory).

Candidates: two fill rules, "fit" (a W only where it ends before the next op
could start, so it never delays it) and "eager" (every gap), each under
`mem_limit` and under the input's own peak memory (forcing Ws into the early
small gaps often shortens the tail). The pass returns the candidate with the
smallest simulated makespan (then the least memory), and the input itself if
none beats it, so the makespan never grows.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Literal

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import DeadlockError, Engine, Key
from pjit_pipe.ir.memory import MEMORY_DELTA, limit_units, peak_memory
from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.simulator import simulate

FillRule = Literal["fit", "eager"]
_EPS = 1e-9


class _Worker:
    """One worker's replay state: its non-W ops in order, its pending Ws, its output."""

    def __init__(self, program: tuple[Op, ...]):
        self.rest = [op for op in program if op.kind is not Kind.W]
        self.ptr = 0
        self.pending: deque[Op] = deque()
        self.out: list[Op] = []
        self.times: list[tuple[float, float]] = []  # (start, end) of each op of `out`
        self.time = 0.0
        self.mem = 0

    def forced(self, op: Op, limit: float) -> Op | None:
        """A pending W that must run before `op` (`limit` in half-chunk units), or None."""
        if op.kind is Kind.OPT:
            return next((w for w in self.pending if w.stage == op.stage), None)
        if op.kind is Kind.F and self.mem + MEMORY_DELTA[Kind.F] > limit and self.pending:
            return self.pending[0]
        return None


def replay(
    schedule: Schedule, costs: Costs, mem_limit: float | None, rule: FillRule
) -> tuple[Schedule, dict[Worker, list[tuple[float, float]]]]:
    """Re-time `schedule`, placing each W by `rule`: the new schedule, and when each of
    its ops runs ((start, end) per worker, in program order: the engine's own times)."""
    flow = Engine(schedule)
    duration = costs.duration_fn(schedule)
    limit = limit_units(mem_limit, schedule.chunks)
    state = {w: _Worker(schedule.program(w)) for w in schedule.alive_workers}
    resolved: dict[Key, tuple[float, Worker]] = {}
    counts: dict[Key, int] = defaultdict(int)
    latest: dict[Key, float] = defaultdict(float)
    deps: dict[tuple[Worker, Op], list[tuple[Key, bool]]] = {}
    waiting: dict[Key, list[Worker]] = defaultdict(list)
    queue = deque(state)

    def execute(w: Worker, op: Op, start: float) -> None:
        st = state[w]
        st.out.append(op)
        st.time = start + duration(w, op)
        st.times.append((start, st.time))
        st.mem += MEMORY_DELTA.get(op.kind, 0)
        if op.kind is Kind.W:
            st.pending.remove(op)
        elif op.kind is Kind.B:
            st.pending.append(op._replace(kind=Kind.W))
        for key in flow.produces(w, op):
            counts[key] += 1
            latest[key] = max(latest[key], st.time)  # an aggregate is there when its last part is
            if counts[key] == flow.aggregate_size(key):
                resolved[key] = (latest[key], w)
                queue.extend(waiting.pop(key, ()))

    def ready_time(w: Worker, op: Op) -> float | None:
        """When `op`'s inputs are all on `w`, or None while one is not produced yet."""
        t = 0.0
        if (w, op) not in deps:  # asked again each time the worker retries: build keys once
            deps[(w, op)] = flow.deps(w, op)
        for key, cross in deps[(w, op)]:
            if key not in resolved:
                waiting[key].append(w)
                return None
            at, src = resolved[key]
            t = max(t, at + (costs.c if cross and src != w else 0.0))
        return t

    def advance(w: Worker) -> bool:
        """Run `w` as far as it can go; False when it waits for another worker."""
        st = state[w]
        while st.ptr < len(st.rest):
            op = st.rest[st.ptr]
            must = st.forced(op, limit)
            if must is not None:
                execute(w, must, st.time)
                continue
            ready = ready_time(w, op)
            if ready is None:
                return False
            if ready > st.time + _EPS and st.pending:
                w_op = st.pending[0]
                if rule == "eager" or st.time + duration(w, w_op) <= ready + _EPS:
                    execute(w, w_op, st.time)
                    continue
            execute(w, op, max(st.time, ready))
            st.ptr += 1
        while st.pending:
            execute(w, st.pending[0], st.time)
        return True

    done: set[Worker] = set()
    while len(done) < len(state):
        while queue:
            w = queue.popleft()
            if w not in done and advance(w):
                done.add(w)
        stuck = [w for w in state if w not in done and state[w].pending]
        if len(done) < len(state):
            if not stuck:
                raise DeadlockError("defer_w: the input schedule deadlocks")
            for w in stuck:  # give back what the input ran earlier: W waits for nothing remote
                st = state[w]
                execute(w, st.pending[0], st.time)
                queue.append(w)
    programs = {w: st.out for w, st in state.items()}
    return schedule.replace(programs=programs), {w: st.times for w, st in state.items()}


def defer_w(
    schedule: Schedule, costs: Costs | None = None, mem_limit: float | None = None
) -> Schedule:
    """Move W ops into bubbles without raising the simulated makespan or exceeding `mem_limit`."""
    costs = costs or Costs()
    if mem_limit is not None and not mem_limit > 0:
        raise ScheduleError(f"mem_limit must be > 0, got {mem_limit}")
    own_peak = max(peak_memory(schedule).values(), default=0.0)
    limits = [mem_limit]
    if own_peak > 0 and (mem_limit is None or own_peak < mem_limit):
        limits.append(own_peak)

    def rank(s: Schedule, is_input: bool) -> tuple[float, float, bool]:
        return simulate(s, costs).makespan, max(peak_memory(s).values(), default=0.0), is_input

    best, best_key = schedule, rank(schedule, True)
    for limit in limits:
        for rule in ("fit", "eager"):
            cand, _ = replay(schedule, costs, limit, rule)
            key = rank(cand, False)
            if (mem_limit is None or key[1] <= mem_limit + _EPS) and key < best_key:
                best, best_key = cand, key
    if best is schedule:
        return schedule
    return best.replace(kind=f"{schedule.kind}+defer_w")
