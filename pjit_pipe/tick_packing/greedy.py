"""The greedy that packs a schedule into ticks, one tick at a time.

`pack_ticks` (tick_packing/packer.py) runs it in each of a few variants and lane
orders and keeps the cheapest table. Each tick, every worker lists its ready
ops, oldest first: an op is ready when each message it reads was made in an
earlier tick and each residual earlier or in an earlier lane of this tick
(ir/ticks.py's rule); a younger op may overtake an older one that waits, but
only within the memory limit and leaving room for the rest of the program in
program order (so the greedy never deadlocks), and never past an OPT. Each
worker's picks are priced by the time it would keep the tick (with its
messages sent at once, or deferred: tick_packing/send_timing.py), and the tick's
length is then chosen by a rule (tick_packing/tick_length.py). A variant may take
one W a tick or up to ir.ticks.W_PER_TICK. The OPTs of a stage run together at the end of the
tick that completes its gradients (one reduction); a worker's run of OPTs
goes in any order, since its replicas may step their stages in another.
"""

from __future__ import annotations

from collections.abc import Mapping

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import DeadlockError, Engine, StageGrads, Stamped, Tensor
from pjit_pipe.ir.memory import MemoryBound
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Op, Payload, Worker
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import (
    FORWARD_FIRST,
    W_PER_TICK,
    Entry,
    LaneOrder,
    PackedTicks,
    fused_loss_ops,
    is_message,
    lane_order,
    lanes,
    late_channel,
    sends_late,
)
from pjit_pipe.tick_packing.held_memory import Held, add, highest, rise
from pjit_pipe.tick_packing.tick_length import RULES, cut

# The greedy variants pack_ticks prices: (rule, whether a W may overtake, whether a W
# waits for a tick its worker has nothing else for). A lazy W lets a staggered
# table run a stage's last W's after the next iteration has started elsewhere.
VARIANTS = [(r, o, False) for r in RULES for o in (True, False)] + [(r, True, True) for r in RULES]


_SCAN = 64  # how far past a worker's oldest unplaced op the greedy looks for ready ones


class _Worker:
    """One worker's unplaced entries, in program order, and its memory so far."""

    def __init__(self, entries: list[Entry]):
        self.entries = entries
        self.position = {e: i for i, e in enumerate(entries)}
        self.placed = [False] * len(entries)
        self.ptr = 0  # the oldest unplaced entry
        self.memory = (0, 0, 0)  # (units, B-pool rows, W-pool rows): MemoryBound.delta
        self.after_opt = -1  # tick of this worker's latest OPT: its next op runs later
        # Per entry: how many of its dependencies (in PackingFacts.deps order) are
        # known done, and the message it last waited for (done never changes, so
        # the next check starts there).
        self.deps_done = [0] * len(entries)
        self.waits_for: list[Stamped | None] = [None] * len(entries)

    def advance(self) -> None:
        while self.ptr < len(self.entries) and self.placed[self.ptr]:
            self.ptr += 1


class PackingFacts:
    """What every greedy variant of one (schedule, costs, memory limit) reads and
    none changes: each op's dependencies and products, its price and its memory
    delta. `pack_ticks` builds it once and hands it to each of its variants."""

    def __init__(self, sched: Schedule, costs: Costs, mem_limit: float | None):
        self.flow = Engine(sched)
        duration = costs.duration_fn(sched)
        crosses = {key for w, _, op in sched.ops() for key, cross in self.flow.deps(w, op) if cross}
        # What each worker may hold (mem_limit as in pack_ticks: None, the schedule's own).
        self.bound = MemoryBound.of(sched, mem_limit)
        self.delta = {op: self.bound.delta(op) for _, _, op in sched.ops()}
        # Per (worker, op): what it waits for (key, whether a message) and what it makes.
        self.deps = {
            (w, op): [(k, is_message(k, op)) for k, _ in self.flow.deps(w, op)]
            for w, _, op in sched.ops()
        }
        self.produces = {(w, op): self.flow.produces(w, op) for w, _, op in sched.ops()}
        # Per (worker, op): the messages it reads from another worker.
        self.reads = {
            (w, op): [key for key, cross in self.flow.deps(w, op) if cross]
            for w, _, op in sched.ops()
        }
        # Per (worker, op): its duration, and C when it sends a message to another worker.
        self.cost = {
            (w, op): (
                duration(w, op),
                costs.c if any(k in crosses for k in self.produces[(w, op)]) else 0.0,
            )
            for w, _, op in sched.ops()
        }
        # The price scale of a loss-stage F and backward that share a tick (one program).
        self.fusion, self.loss_stage = costs.loss_fusion(sched), sched.num_virtual_stages - 1
        self.holders: dict[int, int] = {}  # stage -> how many workers run an OPT of it
        for _, _, op in sched.ops():
            if op.kind is Kind.OPT:
                self.holders[op.stage] = self.holders.get(op.stage, 0) + 1


class GreedyPacker:
    """Build a table one tick at a time under one variant and lane order (module
    docstring); `run(rule)` returns it."""

    def __init__(
        self,
        sched: Schedule,
        costs: Costs,
        iterations: int,
        mem_limit: float | None,
        overtaking_w: bool = True,
        lazy_w: bool = False,
        order: LaneOrder = FORWARD_FIRST,
        w_per_tick: int = W_PER_TICK,
        facts: PackingFacts | None = None,
        deferred: bool = False,
    ):
        self.sched, self.costs, self.iterations = sched, costs, iterations
        self.order = order  # the lane order of the table (ir/ticks.py)
        # Whether the table sends its late channel at the start of the next tick, and
        # so prices a tick as `simulator.simulate.packed_events` prices a deferred one.
        self.deferred = deferred
        self.w_per_tick = w_per_tick  # the W's a worker may run in one tick (<= W_PER_TICK)
        self.overtaking_w = overtaking_w  # whether a W may run ahead of an older op
        self.lazy_w = lazy_w  # whether a W runs only in a tick the worker has nothing else for
        facts = facts or PackingFacts(sched, costs, mem_limit)
        self.flow, self.bound, self.delta = facts.flow, facts.bound, facts.delta
        self.deps, self.produces, self.cost = facts.deps, facts.produces, facts.cost
        # Per (worker, op): the messages it reads on the late channel, and the ops that
        # send one to another worker, and the ticks that made one (deferred only).
        self.late_reads: dict[tuple[Worker, Op], list[Tensor]] = {}
        self.late_senders: set[tuple[Worker, Op]] = set()
        self.sent_late: set[int] = set()
        if deferred:
            self.late_senders = {
                (w, op)
                for (w, op), (_, send) in facts.cost.items()
                if send and sends_late(op.kind, order)
            }
            # A late message leaves after the tick: its op does not keep the tick for C.
            self.cost = {
                (w, op): (took, 0.0 if sends_late(op.kind, order) else send)
                for (w, op), (took, send) in self.cost.items()
            }
            # (a deferred table's late channel carries one payload: ir.ticks.late_channel)
            late = Payload.ACT if late_channel(order) is Kind.F else Payload.GRAD
            self.late_reads = {
                wop: [key for key in reads if key.payload is late]
                for wop, reads in facts.reads.items()
            }
        self.holders = facts.holders
        self.fusion, self.loss_stage = facts.fusion, facts.loss_stage
        # The lanes each compute kind takes in this order (ir.ticks.lanes, looked up once).
        self.lanes = {kind: lanes(kind, order) for kind in COMPUTE_KINDS}
        self.workers = {
            w: _Worker([(it, op) for it in range(iterations) for op in sched.program(w)])
            for w in sched.alive_workers
        }
        self.done: dict[Stamped, int] = {}  # (iteration, key) -> tick it became available in
        self.counts: dict[tuple, int] = {}
        self.opts_left = {it: self.flow.num_opt for it in range(iterations)}
        self.opt_tick: dict[int, int] = {}

    def run(self, rule: str) -> PackedTicks:
        ticks: list[dict[Worker, tuple[Entry, ...]]] = []
        left = sum(len(st.entries) for st in self.workers.values())
        while left:
            t = len(ticks)
            picks = {w: self._picks(w, st, t) for w, st in self.workers.items()}
            tick = {w: es for w, es in cut(picks, rule, self.order).items() if es}
            for w, es in tick.items():
                for e in es:
                    self._place(w, e, t)
            for w, extra in self._opts(t).items():
                tick[w] = (*tick.get(w, ()), *extra)
            if not tick:
                stuck = [
                    f"{w}: {st.entries[st.ptr][1]}"
                    for w, st in self.workers.items()
                    if st.ptr < len(st.entries)
                ]
                raise DeadlockError(f"tick packing is stuck at tick {t}: {', '.join(stuck[:6])}")
            left -= sum(len(es) for es in tick.values())
            ticks.append(tick)
        return PackedTicks(self.sched, self.iterations, tuple(ticks), self.order, self.deferred)

    def _place(self, w: Worker, entry: Entry, t: int) -> None:
        st = self.workers[w]
        st.placed[st.position[entry]] = True
        st.advance()
        it, op = entry
        st.memory = add(st.memory, self.delta[op])
        if (w, op) in self.late_senders:
            self.sent_late.add(t)
        for k in self.produces[(w, op)]:
            key = (it, k)
            self.counts[key] = self.counts.get(key, 0) + 1
            if self.counts[key] == self.flow.aggregate_size(k):
                self.done[key] = t

    def _opts(self, t: int) -> dict[Worker, tuple[Entry, ...]]:
        """The OPTs that run at the end of tick t: those whose stage's gradients are
        complete, every holder's at once (one reduction), each holder having run
        everything before its OPT."""
        extra: dict[Worker, list[Entry]] = {}
        while True:
            # A worker's next OPTs, up to its next compute op, in any order: replicas
            # may order two stages' OPTs differently, and each stage's must share a tick.
            at: dict[tuple[int, int], list[tuple[Worker, int]]] = {}
            for w, st in self.workers.items():
                i = st.ptr
                while i < len(st.entries) and st.entries[i][1].kind is Kind.OPT:
                    if not st.placed[i]:
                        it, op = st.entries[i]
                        at.setdefault((op.stage, it), []).append((w, i))
                    i += 1
            ready = [
                (key, ws)
                for key, ws in at.items()
                if len(ws) == self.holders[key[0]] and (key[1], StageGrads(key[0])) in self.done
            ]
            if not ready:
                return {w: tuple(es) for w, es in extra.items()}
            for (_, it), ws in ready:
                for w, i in ws:
                    st = self.workers[w]
                    entry = st.entries[i]
                    self._place(w, entry, t)
                    st.after_opt = t
                    extra.setdefault(w, []).append(entry)
                self.opts_left[it] -= len(ws)
                self.opt_tick[it] = t

    def _ready(self, w: Worker, st: _Worker, i: int, t: int, here: dict[Stamped, int]) -> bool:
        """Whether the worker's entry i may run in tick t: the barrier is behind it,
        each message was made in an earlier tick, each residual earlier or in an
        earlier lane of t (`here`: what the worker's ops chosen for t make, by lane
        position). While tick t is chosen, everything in `done` was made before it."""
        it, op = st.entries[i]
        barrier = it > 0 and not self.sched.staggered
        if barrier and (self.opts_left[it - 1] or self.opt_tick.get(it - 1, -1) >= t):
            return False
        deps, done = self.deps[(w, op)], self.done
        n = st.deps_done[i]
        while n < len(deps) and (it, deps[n][0]) in done:
            n += 1
        st.deps_done[i] = n
        lane = self.lanes[op.kind][0]
        for key, message in deps[n:]:
            k = (it, key)
            if k not in done:
                if message:
                    st.waits_for[i] = k
                    return False
                if here.get(k, lane) >= lane:
                    return False
        return True

    def _picks(self, w: Worker, st: _Worker, t: int) -> list[tuple[Entry, float]]:
        """The worker's ready ops for tick t, oldest first (a younger op overtakes
        an older one that waits, within the memory limit and never past an OPT),
        each with the worker's time in the tick if the tick kept the ops up to it."""
        if st.after_opt >= t:
            return []
        chosen: list[Entry] = []
        here: dict[Stamped, int] = {}
        for skip_w in (True, False) if self.lazy_w else (False,):
            self._choose(w, st, t, skip_w, chosen, here)
            if chosen:
                break
        floor = self.costs.c if t - 1 in self.sent_late else 0.0
        return [
            (
                chosen[n - 1],
                self.worker_time(w, lane_order(chosen[:n], self.order), t, self.done, floor),
            )
            for n in range(1, len(chosen) + 1)
        ]

    def worker_time(
        self,
        w: Worker,
        entries: list[Entry],
        tick: int,
        made: Mapping[Stamped, int],
        floor: float = 0.0,
    ) -> float:
        """How long worker w keeps tick `tick` running `entries`, in the order given (the
        table's lane order): its ops, and C after each op that sends a message (as
        `simulator.simulate.packed_events` prices it, a fused loss-stage group too).
        Deferred, a late message leaves after the tick instead, and an op that reads
        one made in the tick before (`made`: the tick each message was made in)
        starts no earlier than C into the tick; `floor`: the least the tick lasts (C
        after a tick that made a late message, which lands in this one)."""
        busy, end = 0.0, floor
        fused = fused_loss_ops(entries, self.loss_stage) if self.fusion != 1.0 else ()
        for entry in entries:
            took, send = self.cost[(w, entry[1])]
            if self.deferred and any(
                made.get((entry[0], key)) == tick - 1 for key in self.late_reads[(w, entry[1])]
            ):
                busy = max(busy, self.costs.c)
            busy += took * self.fusion if entry in fused else took
            if send:
                end = max(end, busy + send)
        return max(busy, end)

    def _choose(
        self,
        w: Worker,
        st: _Worker,
        t: int,
        skip_w: bool,
        chosen: list[Entry],
        here: dict[Stamped, int],
    ) -> None:
        """Add to `chosen` the worker's ready ops for tick t, oldest first (W's left
        out when `skip_w`), and what they make to `here`."""
        taken = {lane for _, o in chosen for lane in self.lanes[o.kind]}
        ws = sum(o.kind is Kind.W for _, o in chosen)  # W's in the W lane
        window = None  # the unplaced entries' memory deltas, made when first needed
        for i in range(st.ptr, min(len(st.entries), st.ptr + _SCAN)):
            if st.placed[i]:
                continue
            it, op = st.entries[i]
            if op.kind is Kind.OPT:
                break
            if op.kind is Kind.W and (skip_w or (i > st.ptr and not self.overtaking_w)):
                continue  # a W kept in program order (or for an idle tick) fills a later bubble
            another_w = op.kind is Kind.W and 0 < ws < self.w_per_tick
            if not another_w and not taken.isdisjoint(self.lanes[op.kind]):
                continue
            waits = st.waits_for[i]  # a message not yet made: not ready, skip the check
            if (waits is not None and waits not in self.done) or not self._ready(w, st, i, t, here):
                continue
            # Ops of a tick run in lane order (an op's same-tick dependencies are in
            # earlier lanes), so memory peaks in that order too. An op that overtakes
            # must leave room for the rest of the program, in program order, from
            # the memory after the tick (no deadlock).
            mem = peak = st.memory
            for _, o in lane_order([*chosen, (it, op)], self.order):
                mem = add(mem, self.delta[o])
                peak = highest(peak, mem)
            if not self.bound.admits(peak):
                continue
            if i > st.ptr:
                window = window or self._window(st)
                still = rise(window, {st.position[e] for e in chosen} | {i})
                if not self.bound.admits(add(mem, still)):
                    continue
            chosen.append((it, op))
            taken.update(self.lanes[op.kind])
            ws += op.kind is Kind.W
            lane = self.lanes[op.kind][-1]
            here.update(((it, k), lane) for k in self.produces[(w, op)])
            if len(taken) == 3 and ws in (0, self.w_per_tick):  # every lane is full
                break

    def _window(self, st: _Worker) -> list[tuple[int, Held]]:
        """The worker's unplaced entries within the greedy's scan, in program order:
        (position, memory delta)."""
        return [
            (i, self.delta[st.entries[i][1]])
            for i in range(st.ptr, min(len(st.entries), st.ptr + _SCAN))
            if not st.placed[i]
        ]
