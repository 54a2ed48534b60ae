"""Peer re-routing: run failed workers' microbatches on surviving peers of the same stage.

Replicas hold identical stage parameters, so the microbatches of a failed
worker (r, p) can run stage p on any surviving (r', p): nothing is lost and no
spare is needed. The extra work fits the peers' bubbles only when the backward
is split into B and W (W waits for idle time) and each stage steps its
optimizer as soon as its own gradients are reduced (staggering).

Programs are built by a list scheduler that replays the dataflow semantics of
`pjit_pipe.ir.dataflow` over a few back-to-back iterations: a free worker runs
a ready B first (it unblocks the stage above), else a ready F while memory
allows, else a pending W. Later iterations start where earlier ones left the
pipeline, so their programs are the steady-state ones.

`reroute` is the pass: one balanced assignment, op priorities taken from the
input schedule. `schedule_with_failures` searches assignments and priority
orders and keeps the shortest steady iteration period under the memory limit.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern, inverse, permute_replicas
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import BW, OPT, B, F, Kind, Op, W, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.validate import validate
from pjit_pipe.simulator.bounds import lower_bound
from pjit_pipe.simulator.simulate import simulate

Slot = tuple[int, int, int]  # (virtual stage, microbatch, home replica)
Placement = dict[Slot, Worker]
Failed = FailurePattern | Iterable[tuple[int, int]]

ORDERS = ("interleave", "last", "first")
STEADY_ITERATIONS = 6


def assign(
    schedule: Schedule, pattern: FailurePattern, offset: int = 0, blocks: bool = False
) -> Placement:
    """Which live worker runs each slot: own work stays home, orphans spread over survivors.

    All chunks of one orphaned microbatch go to the same peer. Orphans are
    dealt round-robin starting at survivor `offset` (or in contiguous blocks),
    so survivors' loads differ by at most one microbatch.
    """
    placement: Placement = {}
    for p in range(schedule.stages):
        held = schedule.held_stages(p)
        alive = pattern.survivors(p)
        orphans = [
            (j, r)
            for j in range(schedule.microbatches)
            for r in range(schedule.replicas)
            if r not in alive
        ]
        n = len(alive)
        for i, (j, r) in enumerate(orphans):
            k = (i * n) // len(orphans) if blocks else i
            peer = Worker(alive[(k + offset) % n], p)
            placement.update({(s, j, r): peer for s in held})
        for r in alive:
            placement.update(
                {(s, j, r): Worker(r, p) for s in held for j in range(schedule.microbatches)}
            )
    return placement


def _ranks(schedule: Schedule) -> tuple[dict[Slot, int], dict[Slot, int]]:
    """Position of each slot's F, and of its B/BW, among its worker's forwards/backwards."""
    frank: dict[Slot, int] = {}
    brank: dict[Slot, int] = {}
    for prog in schedule.programs.values():
        nf = nb = 0
        for op in prog:
            slot = (op.stage, op.mb, op.replica)
            if op.kind is Kind.F:
                frank[slot], nf = nf, nf + 1
            elif op.kind in (Kind.B, Kind.BW):
                brank[slot], nb = nb, nb + 1
    return frank, brank


def priorities(
    schedule: Schedule, placement: Placement, order: str = "interleave"
) -> tuple[Callable[[Slot], tuple], Callable[[Slot], tuple]]:
    """Sort keys for choosing among ready F (first) and ready B (second) on a worker.

    Ranks come from the input schedule's programs; `order` says where
    re-routed slots go among a peer's own: by rank ("interleave"), after
    ("last") or before ("first") them.
    """
    if order not in ORDERS:
        raise ScheduleError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    frank, brank = _ranks(schedule)

    def keyed(rank: dict[Slot, int]) -> Callable[[Slot], tuple]:
        def key(slot: Slot) -> tuple:
            moved = int(placement[slot].replica != slot[2])
            group = {"interleave": 0, "last": moved, "first": 1 - moved}[order]
            return (group, rank[slot], moved, slot[2], slot[0])

        return key

    return keyed(frank), keyed(brank)


@dataclass
class _State:
    """A worker's progress through its current iteration."""

    iteration: int = 0
    fdone: set = field(default_factory=set)
    bdone: set = field(default_factory=set)
    wqueue: deque = field(default_factory=deque)
    mem: int = 0
    reserved: int = 0
    opts: list = field(default_factory=list)
    computed: int = 0


class _ListScheduler:
    """Greedy event-driven construction of per-worker programs (see the module docstring)."""

    def __init__(
        self,
        base: Schedule,
        pattern: FailurePattern,
        placement: Placement,
        fkey: Callable[[Slot], tuple],
        bkey: Callable[[Slot], tuple],
        costs: Costs,
        caps: dict[Worker, float | None],
        split: bool,
        staggered: bool,
        reserve: bool,
    ):
        self.base, self.placement, self.split, self.staggered = base, placement, split, staggered
        self.reserve = reserve
        self.live = [w for w in base.workers if w not in pattern.failed]
        self.last = base.num_virtual_stages - 1
        v = base.chunks
        table = costs.per_stage(base.stages)
        self.c, self.opt_cost = costs.c, costs.opt
        self.dur = {
            (kind, s): x / v
            for s in range(base.num_virtual_stages)
            for kind, x in zip((Kind.F, Kind.B, Kind.W), table[base.layout[s]], strict=True)
        }
        for s in range(base.num_virtual_stages):
            self.dur[(Kind.BW, s)] = self.dur[(Kind.B, s)] + self.dur[(Kind.W, s)]
        mine: dict[Worker, list[Slot]] = {w: [] for w in self.live}
        for slot, w in placement.items():
            mine[w].append(slot)
        self.forder = {w: sorted(sl, key=fkey) for w, sl in mine.items()}
        self.border = {w: sorted(sl, key=bkey) for w, sl in mine.items()}
        self.held = {w: base.held_stages(w.stage) for w in self.live}
        self.holders = {
            s: [w for w in self.live if w.stage == base.layout[s]] for s in range(self.last + 1)
        }
        self.need_w = base.replicas * base.microbatches
        self.num_opt = sum(len(h) for h in self.held.values())
        self.cap = {}
        for w in self.live:
            limit = caps.get(w)
            units = math.inf if limit is None else math.floor(limit * 2 * v + 1e-9)
            if units < 2 * v:
                raise ScheduleError(
                    f"mem_limit {limit:g} on worker {w} is below one microbatch's activations (1), "
                    "which a worker holds until the microbatch has passed all its chunks"
                )
            self.cap[w] = units
        # Chunks a microbatch still visits on the same worker after virtual stage s.
        self.ahead = [
            sum(t > s for t in base.held_stages(base.layout[s])) for s in range(self.last + 1)
        ]
        self.first = {min(base.held_stages(p)) for p in range(base.stages)}

    def run(self, iterations: int) -> list[dict[Worker, list[Op]]]:
        """Programs of each of `iterations` back-to-back iterations."""
        self.arrival: dict[tuple, float] = {}
        self.wcount: dict[tuple, list] = {}
        self.optcount: dict[int, list] = {}
        self.events: list[float] = []
        self.checked = dict.fromkeys(self.live, False)
        logs = [{w: [] for w in self.live} for _ in range(iterations)]
        state = {w: _State(opts=list(self.held[w])) for w in self.live}
        t = dict.fromkeys(self.live, 0.0)
        active = set(self.live)
        while active:
            w = min(active, key=lambda u: (t[u], self.checked[u], u))
            if self.checked[w]:  # every worker at the earliest time is stuck: advance the clock
                t0 = t[w]
                while self.events and self.events[0] <= t0:
                    heapq.heappop(self.events)
                later = [t[u] for u in active if t[u] > t0] + self.events[:1]
                if not later:
                    raise ScheduleError(
                        "no worker can make progress: the memory limit is too small for this "
                        f"placement (stuck at {sorted(active)[0]})"
                    )
                nxt = min(later)
                for u in active:
                    if t[u] == t0:
                        t[u], self.checked[u] = nxt, False
                continue
            st = state[w]
            op = self._choose(w, st, t[w])
            if op is None:
                self.checked[w] = True
                continue
            end = t[w] + (self.opt_cost if op.kind is Kind.OPT else self.dur[(op.kind, op.stage)])
            logs[st.iteration][w].append(op)
            self._apply(w, st, op, end)
            t[w] = end
            heapq.heappush(self.events, end)
            if st.iteration == iterations:
                active.discard(w)
        return logs

    def _ready(self, key: tuple, now: float) -> bool:
        return self.arrival.get(key, math.inf) <= now

    def _choose(self, w: Worker, st: _State, now: float) -> Op | None:
        it = st.iteration
        if not self.staggered and it > 0 and st.computed == 0 and not st.fdone:
            got = self.optcount.get(it - 1, (0, 0.0))
            if got[0] < self.num_opt or got[1] > now:
                return None
        if st.computed < len(self.forder[w]):
            for s, j, r in self.border[w]:
                started = (s, j, r) in st.fdone and (s, j, r) not in st.bdone
                if started and (s == self.last or self._ready((it, "grad", s + 1, j, r), now)):
                    return (B if self.split else BW)(s, j, r)
            for s, j, r in self.forder[w]:
                if (
                    (s, j, r) not in st.fdone
                    and self._fits(w, st, s)
                    and (s == 0 or self._ready((it, "act", s - 1, j, r), now))
                ):
                    return F(s, j, r)
            if st.wqueue:
                return W(*st.wqueue[0])
            return None
        for s in st.opts:
            count, at = self.wcount.get((it, s), (0, 0.0))
            if count == self.need_w and at <= now:
                return OPT(s, w.replica)
        return None

    def _fits(self, w: Worker, st: _State, s: int) -> bool:
        """Whether F of chunk s fits in memory: a microbatch entering the worker
        reserves room for all its chunks there, so it can never get stuck halfway
        (without `reserve`, chunks > 1 may deadlock at a tight limit: ScheduleError)."""
        if not self.reserve:
            return st.mem + 2 <= self.cap[w]
        if s not in self.first:
            return True  # its room was reserved when it entered
        return st.mem + st.reserved + 2 * (1 + self.ahead[s]) <= self.cap[w]

    def _send(self, key: tuple, src: Worker, dst: Worker, end: float) -> None:
        at = end + (self.c if src != dst else 0.0)
        self.arrival[key] = at
        heapq.heappush(self.events, at)
        self.checked[dst] = False

    def _apply(self, w: Worker, st: _State, op: Op, end: float) -> None:
        it, s, j, r = st.iteration, op.stage, op.mb, op.replica
        if op.kind is Kind.OPT:
            st.opts.remove(s)
            if not st.opts:
                count, at = self.optcount.get(it, (0, 0.0))
                self.optcount[it] = (count + len(self.held[w]), max(at, end))
                st.iteration, st.fdone, st.bdone, st.computed = it + 1, set(), set(), 0
                st.opts = list(self.held[w])
                if self.optcount[it][0] == self.num_opt:
                    self.checked.update(dict.fromkeys(self.live, False))
            return
        if op.kind is Kind.F:
            st.fdone.add((s, j, r))
            st.mem += 2
            st.reserved += 2 * self.ahead[s] if s in self.first else -2
            if s < self.last:
                self._send((it, "act", s, j, r), w, self.placement[(s + 1, j, r)], end)
            return
        if op.kind in (Kind.B, Kind.BW):
            st.bdone.add((s, j, r))
            if s > 0:
                self._send((it, "grad", s, j, r), w, self.placement[(s - 1, j, r)], end)
            if op.kind is Kind.B:
                st.mem -= 1
                st.wqueue.append((s, j, r))
                return
            st.mem -= 2
        else:  # W
            st.wqueue.popleft()
            st.mem -= 1
        st.computed += 1
        count, at = self.wcount.get((it, s), (0, 0.0))
        self.wcount[(it, s)] = (count + 1, max(at, end))
        if count + 1 == self.need_w:
            self.checked.update(dict.fromkeys(self.holders[s], False))


def list_schedule(
    base: Schedule,
    pattern: FailurePattern,
    placement: Placement,
    costs: Costs,
    caps: dict[Worker, float | None],
    order: str = "interleave",
    split: bool = True,
    staggered: bool = True,
    iterations: int = 3,
    kind: str = "reroute",
    reserve: bool = True,
) -> list[Schedule]:
    """One schedule per simulated iteration of the list scheduler (later = steadier)."""
    fkey, bkey = priorities(base, placement, order)
    sched = _ListScheduler(
        base, pattern, placement, fkey, bkey, costs, caps, split, staggered, reserve
    )
    return [
        base.replace(programs=progs, failed=pattern.failed, staggered=staggered, kind=kind)
        for progs in sched.run(iterations)
    ]


def steady_period(schedule: Schedule, costs: Costs, iterations: int = STEADY_ITERATIONS) -> float:
    """Iteration period once the pipeline is in its steady state."""
    return simulate(schedule, costs, iterations=iterations).steady_period


def best_of(candidates: Iterable[Schedule], costs: Costs, target: float = -math.inf) -> Schedule:
    """The candidate with the shortest steady period (the first one on ties).

    Stops at the first candidate whose period reaches `target` (a lower bound).
    """
    best, best_period = None, math.inf
    for cand in candidates:
        period = steady_period(cand, costs)
        if period < best_period - 1e-9:
            best, best_period = cand, period
        if best_period <= target + 1e-9:
            break
    return best


def _default_limit(schedule: Schedule, mem_limit: float | None) -> float:
    return max(peak_memory(schedule).values()) if mem_limit is None else mem_limit


def _symmetric_under(schedule: Schedule, perm: tuple[int, ...]) -> bool:
    moved = permute_replicas(schedule, perm)
    return moved.programs == schedule.programs and moved.failed == schedule.failed


def _canonically(
    schedule: Schedule, pattern: FailurePattern, build: Callable[[FailurePattern], Schedule]
) -> Schedule:
    """Build for the canonical pattern and relabel back, when the input allows it.

    Patterns equal up to a permutation of replicas then share one schedule.
    """
    canon, perm = pattern.canonical()
    if not _symmetric_under(schedule, perm):
        return build(pattern)
    return permute_replicas(build(canon), inverse(perm))


def reroute(
    schedule: Schedule,
    failed: Failed,
    costs: Costs | None = None,
    mem_limit: float | None = None,
) -> Schedule:
    """Re-route the failed workers' microbatches to surviving peers; B/W split, staggered.

    `mem_limit` defaults to the input schedule's peak activation memory. The
    result validates under that limit.
    """
    costs = costs or Costs()
    pattern = FailurePattern.of(schedule.replicas, schedule.stages, failed)
    pattern = FailurePattern(schedule.replicas, schedule.stages, pattern.failed | schedule.failed)
    limit = _default_limit(schedule, mem_limit)

    def build(pat: FailurePattern) -> Schedule:
        placement = assign(schedule, pat)
        caps = dict.fromkeys(schedule.workers, limit)
        runs = list_schedule(schedule, pat, placement, costs, caps, kind=f"{schedule.kind}+reroute")
        return best_of(runs[1:], costs)

    return validate(_canonically(schedule, pattern, build), mem_limit=limit)


def schedule_with_failures(
    kind: str,
    stages: int,
    microbatches: int,
    replicas: int,
    failed: Failed,
    costs: Costs | None = None,
    mem_limit: float | None = None,
    chunks: int | None = None,
    time_limit: float = 10.0,
) -> Schedule:
    """The re-routed schedule with the shortest steady iteration period found.

    Starts from the fault-free `kind` schedule (its op order gives the
    priorities) and tries every round-robin rotation and a block assignment of
    orphaned microbatches, each with re-routed work interleaved, last or first
    (with chunks > 1, each also without reserving memory for a microbatch's
    later chunks, which is faster when it does not get stuck). Stops as soon as a candidate reaches the work-conserving lower bound, or
    after `time_limit` seconds. `mem_limit` defaults to the fault-free
    schedule's peak memory; `chunks` defaults to the kind's own. Patterns equal
    up to a permutation of replicas get one schedule, relabelled (unless the
    time limit cuts their searches at different points).
    """
    from pjit_pipe.schedules import make_schedule

    if kind == "async-1f1b":
        raise ScheduleError(
            "failed workers with schedule async-1f1b are not supported yet: re-routing "
            "rebuilds a synchronous iteration; use a synchronous kind such as 1f1b or zb-h1"
        )
    costs = costs or Costs()
    pattern = FailurePattern.of(replicas, stages, failed)
    base = make_schedule(kind, stages, microbatches, chunks, costs, mem_limit, replicas)
    target = lower_bound(stages, microbatches, replicas, pattern, costs, base.chunks)
    limit = _default_limit(base, mem_limit)
    caps = dict.fromkeys(base.workers, limit)
    deadline = time.monotonic() + time_limit

    def candidates(pat: FailurePattern):
        spread = max(len(pat.survivors(p)) for p in range(stages))
        assignments = [(k, False) for k in range(spread)] + [(0, True)]
        name = f"{kind}+reroute"
        reserves = (False,) if base.chunks == 1 else (False, True)  # same thing when v=1
        for order in ORDERS:
            for offset, blocks in assignments:
                placement = assign(base, pat, offset, blocks)
                for reserve in reserves:
                    try:
                        yield from list_schedule(
                            base, pat, placement, costs, caps, order, reserve=reserve, kind=name
                        )[1:]
                    except ScheduleError:
                        if reserve:
                            raise
                        # stuck without reservation: the reserving run follows
                if time.monotonic() > deadline:
                    return

    result = _canonically(base, pattern, lambda pat: best_of(candidates(pat), costs, target))
    return validate(result, mem_limit=limit)
