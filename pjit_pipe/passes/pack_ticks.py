"""Pack each worker's program into ticks: the table the lowering compiles.

A tick of the compiled program lasts as long as its slowest worker (plus a
transfer time where a message leaves a worker after its last op). Running one
op per tick makes a worker doing F wait for a neighbour doing BW; packing
several ops of a worker into one tick (ir/ticks.py's lane rule: at most one
F, one B and one W, or one F and one BW, in that order) lets every worker
fill the tick. The objective is the sum over ticks of the tick's length, as
the simulator's lockstep mode prices it (`simulator.simulate.packed_events`),
plus each tick's fixed cost (`Costs.tick`): when ticks are dear, fewer win.

`pack_ticks` is the one function that builds the table: the frontend hands
its result to the lowering and the CLI prices it. It runs a fast greedy in a
few variants (`VARIANTS`), improves each table by a local search that pulls
ops one tick earlier (`passes/pull_forward.py`), and keeps the cheapest; a synchronous
schedule packs one iteration and repeats it (behind the barrier every
iteration starts from the same state). `exact_pack` (a HiGHS MILP) finds the
optimum of small cases, to check the greedy against.

Memory: packing keeps each worker's program order, so the activation memory
(and any --mem-limit the schedule was built under) is unchanged. OPTs and
the iteration barrier follow the rule of ir/ticks.py, so staggered schedules
keep their placement. An asynchronous schedule (async-1f1b) is not packed:
its table must run each worker's ops in their exact stream order (which
weights a forward reads depends on the OPTs before it), so `pack_ticks`
returns its unpacked table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import DeadlockError, Engine, StageGrads, Stamped
from pjit_pipe.ir.memory import MEMORY_DELTA, largest_peak, limit_units
from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import LANES, Entry, PackedTicks, compute_only, is_message, lane_order
from pjit_pipe.passes.pull_forward import PullForward
from pjit_pipe.simulator.simulate import packed_time

# How the greedy picks each tick's length from the workers' ready prefixes.
RULES = ("utilization", "shortest", "longest")
# The greedy variants pack_ticks prices: (rule, whether a W may overtake, whether a W
# waits for a tick its worker has nothing else for). A lazy W lets a staggered
# table run a stage's last W's after the next iteration has started elsewhere.
VARIANTS = [(r, o, False) for r in RULES for o in (True, False)] + [(r, True, True) for r in RULES]


# Activation memory of one op, in units of 1/(2v) of a stage's (see ir/memory.py).
_SCAN = 64  # how far past a worker's oldest unplaced op the greedy looks for ready ones


class _Worker:
    """One worker's unplaced entries, in program order, and its memory so far."""

    def __init__(self, entries: list[Entry], cap: float):
        self.entries = entries
        self.position = {e: i for i, e in enumerate(entries)}
        self.placed = [False] * len(entries)
        self.ptr = 0  # the oldest unplaced entry
        self.memory = 0
        self.cap = cap
        self.after_opt = -1  # tick of this worker's latest OPT: its next op runs later

    def advance(self) -> None:
        while self.ptr < len(self.entries) and self.placed[self.ptr]:
            self.ptr += 1


class _Greedy:
    """Build ticks one at a time (see `pack_ticks`)."""

    def __init__(
        self,
        sched: Schedule,
        costs: Costs,
        iterations: int,
        mem_limit: float,
        overtaking_w: bool = True,
        lazy_w: bool = False,
    ):
        self.sched, self.costs, self.iterations = sched, costs, iterations
        self.overtaking_w = overtaking_w  # whether a W may run ahead of an older op
        self.lazy_w = lazy_w  # whether a W runs only in a tick the worker has nothing else for
        self.flow = Engine(sched)
        self.duration = costs.duration_fn(sched)
        self.crosses = set()
        for w, _, op in sched.ops():
            for key, cross in self.flow.deps(w, op):
                if cross:
                    self.crosses.add(key)
        cap = self.cap = limit_units(mem_limit, sched.chunks)
        # Per (worker, op): what it waits for (key, whether a message) and what it makes.
        self.deps = {
            (w, op): [(k, is_message(k, op)) for k, _ in self.flow.deps(w, op)]
            for w, _, op in sched.ops()
        }
        self.produces = {(w, op): self.flow.produces(w, op) for w, _, op in sched.ops()}
        self.workers = {
            w: _Worker([(it, op) for it in range(iterations) for op in sched.program(w)], cap)
            for w in sched.alive_workers
        }
        self.done: dict[Stamped, int] = {}  # (iteration, key) -> tick it became available in
        self.counts: dict[tuple, int] = {}
        self.opts_left = {it: self.flow.num_opt for it in range(iterations)}
        self.opt_tick: dict[int, int] = {}
        self.holders: dict[int, int] = {}  # stage -> how many workers run an OPT of it
        for _, _, op in sched.ops():
            if op.kind is Kind.OPT:
                self.holders[op.stage] = self.holders.get(op.stage, 0) + 1

    def run(self, rule: str) -> PackedTicks:
        ticks: list[dict[Worker, tuple[Entry, ...]]] = []
        left = sum(len(st.entries) for st in self.workers.values())
        while left:
            t = len(ticks)
            picks = {w: self._picks(w, st, t) for w, st in self.workers.items()}
            tick = {w: es for w, es in _cut(picks, rule).items() if es}
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
        return PackedTicks(self.sched, self.iterations, tuple(ticks))

    def _place(self, w: Worker, entry: Entry, t: int) -> None:
        st = self.workers[w]
        st.placed[st.position[entry]] = True
        st.advance()
        it, op = entry
        st.memory += MEMORY_DELTA.get(op.kind, 0)
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
            at: dict[tuple[int, int], list[Worker]] = {}
            for w, st in self.workers.items():
                if st.ptr < len(st.entries) and st.entries[st.ptr][1].kind is Kind.OPT:
                    it, op = st.entries[st.ptr]
                    at.setdefault((op.stage, it), []).append(w)
            ready = [
                (key, ws)
                for key, ws in at.items()
                if len(ws) == self.holders[key[0]] and (key[1], StageGrads(key[0])) in self.done
            ]
            if not ready:
                return {w: tuple(es) for w, es in extra.items()}
            for (_, it), ws in ready:
                for w in ws:
                    st = self.workers[w]
                    entry = st.entries[st.ptr]
                    self._place(w, entry, t)
                    st.after_opt = t
                    extra.setdefault(w, []).append(entry)
                self.opts_left[it] -= len(ws)
                self.opt_tick[it] = t

    def _ready(self, w: Worker, it: int, op: Op, t: int, here: set) -> bool:
        barrier = it > 0 and not self.sched.staggered
        if barrier and (self.opts_left[it - 1] or self.opt_tick.get(it - 1, -1) >= t):
            return False
        for key, message in self.deps[(w, op)]:
            k = (it, key)
            if not (self.done.get(k, t) < t or (not message and k in here)):
                return False
        return True

    def _picks(self, w: Worker, st: _Worker, t: int) -> list[tuple[Entry, float]]:
        """The worker's ready ops for tick t, oldest first (a younger op overtakes
        an older one that waits, within the memory limit and never past an OPT),
        each with the worker's time in the tick if the tick kept the ops up to it."""
        if st.after_opt >= t:
            return []
        chosen: list[Entry] = []
        here: set[Stamped] = set()
        for skip_w in (True, False) if self.lazy_w else (False,):
            self._choose(w, st, t, skip_w, chosen, here)
            if chosen:
                break
        return [
            (chosen[n - 1], self.worker_time(w, lane_order(chosen[:n])))
            for n in range(1, len(chosen) + 1)
        ]

    def worker_time(self, w: Worker, entries: list[Entry]) -> float:
        """How long worker w keeps a tick running `entries`, in the order given (lane
        order): its ops, and C after each op that sends a message (as
        `simulator.simulate.packed_events` prices it)."""
        busy = end = 0.0
        for _, op in entries:
            busy += self.duration(w, op)
            if any(k in self.crosses for k in self.produces[(w, op)]):
                end = max(end, busy + self.costs.c)
        return max(busy, end)

    def _choose(
        self, w: Worker, st: _Worker, t: int, skip_w: bool, chosen: list[Entry], here: set
    ) -> None:
        """Add to `chosen` the worker's ready ops for tick t, oldest first (W's left
        out when `skip_w`), and what they make to `here`."""
        for i in range(st.ptr, min(len(st.entries), st.ptr + _SCAN)):
            if st.placed[i]:
                continue
            it, op = st.entries[i]
            if op.kind is Kind.OPT:
                break
            if op.kind is Kind.W and (skip_w or (i > st.ptr and not self.overtaking_w)):
                continue  # a W kept in program order (or for an idle tick) fills a later bubble
            lanes = {lane for _, o in chosen for lane in LANES[o.kind]}
            if lanes & set(LANES[op.kind]):
                continue
            if not self._ready(w, it, op, t, here):
                continue
            # Ops of a tick run in lane order (an op's same-tick dependencies are in
            # lower lanes), so memory peaks in that order too. An op that overtakes
            # must leave room for the rest of the program, in program order, from
            # the memory after the tick (no deadlock).
            mem = peak = st.memory
            for _, o in lane_order([*chosen, (it, op)]):
                mem += MEMORY_DELTA[o.kind]
                peak = max(peak, mem)
            skip = {st.position[e] for e in chosen} | {i}
            if peak > st.cap or (i > st.ptr and mem + self._rise(st, skip) > st.cap):
                continue
            chosen.append((it, op))
            here.update((it, k) for k in self.produces[(w, op)])
            if len(chosen) == 3:
                break

    @staticmethod
    def _rise(st: _Worker, skip: set[int]) -> int:
        """How far the worker's memory must still rise running its unplaced ops in
        program order (the entries in `skip` left out: the tick's): an op that
        overtakes keeps this much room free, so the program order stays possible
        (no deadlock)."""
        total = rise = 0
        for i in range(st.ptr, min(len(st.entries), st.ptr + _SCAN)):
            if not st.placed[i] and i not in skip:
                total += MEMORY_DELTA.get(st.entries[i][1].kind, 0)
                rise = max(rise, total)
        return rise


def _cut(picks: dict[Worker, list[tuple[Entry, float]]], rule: str):
    """Each worker's longest list of picks (oldest first) within the tick length the
    rule picks, in lane order."""
    firsts = [p[0][1] for p in picks.values() if p]
    if not firsts:
        return {}
    floor = max(firsts)  # every ready worker runs at least one op
    lengths = sorted({tm for p in picks.values() for _, tm in p if tm >= floor})
    if rule == "shortest":
        length = floor
    elif rule == "longest":
        length = lengths[-1]
    else:

        def work(x: float) -> float:
            return sum(max((tm for _, tm in p if tm <= x), default=0.0) for p in picks.values())

        length = max(lengths, key=lambda x: (work(x) / x if x else float("inf"), x))
    out = {}
    for w, p in picks.items():
        kept = [e for e, tm in p if tm <= length]
        out[w] = tuple(lane_order(kept))
    return out


def pack_ticks(
    schedule: Schedule,
    costs: Costs | None = None,
    iterations: int = 1,
    mem_limit: float | None = None,
) -> PackedTicks:
    """The tick table the lowering compiles for `iterations` back-to-back iterations
    of `schedule`, packed to run fast under `costs` (the cheapest greedy variant).

    mem_limit bounds each worker's in-flight activation memory (docs/design.md
    section 3 units) when a younger op runs ahead of one that waits. None takes
    the schedule's own peak (the largest worker's): one SPMD program sizes every
    device's residual store for the largest, so the packed program then holds no
    more activations than the unpacked one. A larger limit (math.inf: none)
    trades memory for speed (`PackedTicks.peak_memory` tells what a table holds).
    An asynchronous schedule gets its unpacked table (module docstring)."""
    if not isinstance(iterations, int) or iterations < 1:
        raise ScheduleError(f"iterations must be a positive integer, got {iterations!r}")
    costs = costs or Costs()
    try:
        key = (_schedule_key(schedule), costs, iterations, mem_limit)
        hash(key)
    except TypeError:  # per-stage costs given as lists: pack without the cache
        return _pack(schedule, costs, iterations, mem_limit)
    # A pipeline, its rebuilt copies and the CLI's pricing pack the same schedule again.
    if key not in _PACKED:
        if len(_PACKED) >= _PACKED_SIZE:
            _PACKED.pop(next(iter(_PACKED)))  # the oldest
        _PACKED[key] = _pack(schedule, costs, iterations, mem_limit)
    return _PACKED[key]


# Packed tables by (schedule, costs, iterations, mem_limit): packing a P=4 schedule
# takes 0.05-0.9 s, as long as a small pipeline's trace.
_PACKED: dict = {}
_PACKED_SIZE = 128


def _schedule_key(schedule: Schedule) -> tuple:
    """Every compared field of `schedule` (its programs as sorted items): equal
    schedules, equal keys, equal tables."""
    values = (getattr(schedule, f.name) for f in dataclasses.fields(schedule) if f.compare)
    return tuple(tuple(sorted(v.items())) if isinstance(v, Mapping) else v for v in values)


def _pack(
    schedule: Schedule, costs: Costs, iterations: int, mem_limit: float | None
) -> PackedTicks:
    """`pack_ticks` without its argument check and cache."""
    sched = compute_only(schedule)
    if mem_limit is None:
        mem_limit = largest_peak(schedule)
    # The unpacked table is a candidate too: packing never makes a schedule slower.
    best = PackedTicks.one_op_per_tick(schedule, iterations)
    if schedule.asynchronous:
        return best
    best_price = packed_time(best, costs)
    if iterations > 1:
        # Behind the iteration barrier every iteration starts from the same state
        # (nothing in flight), so the best one-iteration table, repeated, is as good as
        # any the greedy builds for all of them at once, and costs 1/iterations to build.
        # It is valid staggered too (each stage steps before its next iteration).
        table = _repeat(_pack(schedule, costs, 1, mem_limit), iterations)
        price = packed_time(table, costs)
        if price < best_price - 1e-9:
            best, best_price = table, price
        if not schedule.staggered:
            return best
    for rule, overtaking_w, lazy_w in VARIANTS:
        greedy = _Greedy(sched, costs, iterations, mem_limit, overtaking_w, lazy_w)
        table = greedy.run(rule)
        table = PackedTicks(schedule, iterations, tuple(PullForward(greedy, table).run()))
        price = packed_time(table, costs)
        if price < best_price - 1e-9:
            best, best_price = table, price
    return best


def _repeat(table: PackedTicks, iterations: int) -> PackedTicks:
    """A one-iteration table of a synchronous schedule run `iterations` times back to
    back (its last tick holds its last OPT, so the barrier holds)."""
    ticks = tuple(
        {w: tuple((k, op) for _, op in entries) for w, entries in tick.items()}
        for k in range(iterations)
        for tick in table.ticks
    )
    return PackedTicks(table.schedule, iterations, ticks)
