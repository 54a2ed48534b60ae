"""The list scheduler behind re-routing: a policy over the execution engine's rules.

It builds per-worker programs by running the dataflow rules of
`pjit_pipe.ir.engine` in simulated time over a few back-to-back iterations: a
free worker runs a ready B first (it unblocks the stage above), else a ready F
while memory allows (`pjit_pipe.ir.memory` units), else a pending W. Later
iterations start where earlier ones left the pipeline, so their programs are
the steady-state ones. Each op starts exactly when the engine would start it
in the resulting programs (`ListScheduler.times`; tests/test_engine.py checks).

The policy's knobs: which live worker runs each slot (a `Placement`, from
`pjit_pipe.passes.reroute.assign`), the priority order among ready ops
(`priorities`), fused or split backward, staggered optimizer or barrier, and
whether a microbatch entering a worker reserves room for its later chunks.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import Tensor, consumers, needs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.memory import MEMORY_DELTA, limit_units, units_per_microbatch
from pjit_pipe.ir.ops import BW, OPT, B, F, Kind, Op, Payload, W, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError

Slot = tuple[int, int, int]  # (virtual stage, microbatch, home replica)
Placement = dict[Slot, Worker]

ORDERS = ("interleave", "last", "first")


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
    schedule: Schedule,
    placement: Placement,
    order: str = "interleave",
    jitter: Mapping[Slot, tuple[float, float]] | None = None,
) -> tuple[Callable[[Slot], tuple], Callable[[Slot], tuple]]:
    """Sort keys for choosing among ready F (first) and ready B (second) on a worker.

    Ranks come from the input schedule's programs; `order` says where
    re-routed slots go among a peer's own: by rank ("interleave"), after
    ("last") or before ("first") them. `jitter` shifts a slot's F and B ranks
    by the given amounts: the failure-aware search perturbs the order this way
    where the ranks alone leave a worker idle (one period of ranks fits every
    worker only when their loads are equal).
    """
    if order not in ORDERS:
        raise ScheduleError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    frank, brank = _ranks(schedule)
    shift = jitter or {}

    def keyed(rank: dict[Slot, int], which: int) -> Callable[[Slot], tuple]:
        def key(slot: Slot) -> tuple:
            moved = int(placement[slot].replica != slot[2])
            group = {"interleave": 0, "last": moved, "first": 1 - moved}[order]
            at = rank[slot] + shift[slot][which] if slot in shift else rank[slot]
            return (group, at, moved, slot[2], slot[0])

        return key

    return keyed(frank, 0), keyed(brank, 1)


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


class ListScheduler:
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
        self.speed = costs.factors()  # slow workers' factors; the others run at 1
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
            units = limit_units(limit, v)
            if units < units_per_microbatch(v):
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
        # The engine's dependency rule, as this scheduler asks it: which inputs of an op
        # come from other stages, and which other stages consume what an op makes.
        # (The split or fused backward has the same inputs: B stands for both.)
        self.remote_inputs = {
            (kind, s, j, r): tuple(
                Tensor(pay, src, j, r) for pay, src in needs(kind, s, self.last) if src != s
            )
            for kind in (Kind.F, Kind.B)
            for s, j, r in placement
        }
        self.remote_consumers = {
            (pay, s): sorted({c for _, c in consumers(pay, s, self.last) if c != s})
            for pay in Payload
            for s in range(self.last + 1)
        }

    def run(self, iterations: int) -> list[dict[Worker, list[Op]]]:
        """Programs of each of `iterations` back-to-back iterations."""
        self.arrival: dict[tuple[int, Tensor], float] = {}  # (iteration, tensor) -> on its consumer
        self.wcount: dict[tuple, list] = {}
        self.optcount: dict[int, list] = {}
        self.events: list[float] = []
        self.checked = dict.fromkeys(self.live, False)
        logs = [{w: [] for w in self.live} for _ in range(iterations)]
        # (start, end) of each logged op: the engine's times for these programs.
        self.times = [{w: [] for w in self.live} for _ in range(iterations)]
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
            cost = self.opt_cost if op.kind is Kind.OPT else self.dur[(op.kind, op.stage)]
            end = t[w] + cost * self.speed.get(w, 1.0)
            logs[st.iteration][w].append(op)
            self.times[st.iteration][w].append((t[w], end))
            self._apply(w, st, op, end)
            t[w] = end
            heapq.heappush(self.events, end)
            if st.iteration == iterations:
                active.discard(w)
        return logs

    def _arrived(self, it: int, inputs: tuple[Tensor, ...], now: float) -> bool:
        """Whether the `inputs` an op needs from other stages are on its worker by `now`."""
        return all(self.arrival.get((it, tensor), math.inf) <= now for tensor in inputs)

    def _choose(self, w: Worker, st: _State, now: float) -> Op | None:
        it = st.iteration
        if not self.staggered and it > 0 and st.computed == 0 and not st.fdone:
            got = self.optcount.get(it - 1, (0, 0.0))
            if got[0] < self.num_opt or got[1] > now:
                return None
        if st.computed < len(self.forder[w]):
            for s, j, r in self.border[w]:
                started = (s, j, r) in st.fdone and (s, j, r) not in st.bdone
                if started and self._arrived(it, self.remote_inputs[(Kind.B, s, j, r)], now):
                    return (B if self.split else BW)(s, j, r)
            for s, j, r in self.forder[w]:
                if (
                    (s, j, r) not in st.fdone
                    and self._fits(w, st, s)
                    and self._arrived(it, self.remote_inputs[(Kind.F, s, j, r)], now)
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
            return st.mem + MEMORY_DELTA[Kind.F] <= self.cap[w]
        if s not in self.first:
            return True  # its room was reserved when it entered
        return st.mem + st.reserved + MEMORY_DELTA[Kind.F] * (1 + self.ahead[s]) <= self.cap[w]

    def _send(self, it: int, tensor: Tensor, src: Worker, end: float) -> None:
        """Deliver `tensor` to the worker of the other stage that consumes it.

        (One other stage consumes each tensor: F(s+1) or the backward of s-1, so the
        arrival is keyed by the tensor alone.)
        """
        for stage in self.remote_consumers[(tensor.payload, tensor.stage)]:
            dst = self.placement[(stage, tensor.mb, tensor.replica)]
            at = end + (self.c if src != dst else 0.0)
            self.arrival[(it, tensor)] = at
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
            st.mem += MEMORY_DELTA[Kind.F]
            st.reserved += (
                MEMORY_DELTA[Kind.F] * self.ahead[s] if s in self.first else -MEMORY_DELTA[Kind.F]
            )
            self._send(it, Tensor(Payload.ACT, s, j, r), w, end)
            return
        if op.kind in (Kind.B, Kind.BW):
            st.bdone.add((s, j, r))
            self._send(it, Tensor(Payload.GRAD, s, j, r), w, end)
            st.mem += MEMORY_DELTA[op.kind]
            if op.kind is Kind.B:
                st.wqueue.append((s, j, r))
                return
        else:  # W
            st.wqueue.popleft()
            st.mem += MEMORY_DELTA[Kind.W]
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
    jitter: Mapping[Slot, tuple[float, float]] | None = None,
) -> list[Schedule]:
    """One schedule per simulated iteration of the list scheduler (later = steadier);
    `jitter` shifts op priorities (`priorities`)."""
    fkey, bkey = priorities(base, placement, order, jitter)
    sched = ListScheduler(
        base, pattern, placement, fkey, bkey, costs, caps, split, staggered, reserve
    )
    return [
        base.replace(programs=progs, failed=pattern.failed, staggered=staggered, kind=kind)
        for progs in sched.run(iterations)
    ]
