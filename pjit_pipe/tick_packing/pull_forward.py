"""A local search on a packed tick table: pull ops one tick earlier.

The greedy (tick_packing/greedy.py) builds a table tick by tick; it cuts from a tick
an op that would lengthen it, not knowing the ticks to come. Once the table
is whole, moving such an op one tick earlier can shorten the two ticks in
sum. `PullForward` makes every such move that keeps the table valid by
ir/ticks.py's rule (lanes, messages from an earlier tick, the iteration
barrier or, staggered, the stage's OPT) and within the greedy's memory
limit, until none is left (or a few passes).
"""

from __future__ import annotations

from pjit_pipe.ir.engine import Stamped
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Worker
from pjit_pipe.ir.ticks import Entry, PackedTicks, fits, lane_order
from pjit_pipe.tick_packing.greedy import GreedyPacker
from pjit_pipe.tick_packing.held_memory import add, highest


class PullForward:
    """Local search on a finished table: move an op one tick earlier wherever that
    keeps the table valid and makes the two ticks shorter in sum (an op the
    greedy cut from a tick because it would have lengthened that tick may fit
    once the next ticks are known). Each worker's ops keep their relative order
    except within the tick an op joins (lane order), so memory is re-checked."""

    def __init__(self, greedy: GreedyPacker, table: PackedTicks):
        self.g = greedy
        self.ticks = [{w: list(es) for w, es in tick.items()} for tick in table.ticks]

    def run(self, passes: int = 3) -> list[dict[Worker, tuple[Entry, ...]]]:
        for _ in range(passes):
            self._index()
            moved = False
            for t in range(len(self.ticks) - 1):
                for w, es in list(self.ticks[t + 1].items()):
                    for e in list(es):
                        moved |= self._try(w, e, t)
            self.ticks = [tick for tick in self.ticks if any(tick.values())]
            if not moved:
                break
        return [{w: tuple(es) for w, es in tick.items() if es} for tick in self.ticks]

    def _index(self) -> None:
        """Where each (iteration, key) is made, and the ticks of the OPTs."""
        self.made: dict[Stamped, int] = {}
        self.opt_tick: dict[tuple[int, int], int] = {}  # (stage, iteration) -> tick
        self.last_opt: dict[int, int] = {}  # iteration -> tick of its last OPT
        for t, tick in enumerate(self.ticks):
            for w, es in tick.items():
                for it, op in es:
                    for k in self.g.produces[(w, op)]:
                        self.made[(it, k)] = t
                    if op.kind is Kind.OPT:
                        self.opt_tick[(op.stage, it)] = t
                        self.last_opt[it] = max(self.last_opt.get(it, -1), t)
        # Per tick: the least it lasts (C after a tick that made a late message) and each
        # worker's time in it (GreedyPacker.worker_time), kept up to date (deferred,
        # a pulled op's readers and its ticks' floors are re-priced at the next pass).
        sent_late = {
            t
            for t, tick in enumerate(self.ticks)
            for w, es in tick.items()
            if any((w, op) in self.g.late_senders for _, op in es)
        }
        self.floors = [
            self.g.costs.c if t - 1 in sent_late else 0.0 for t in range(len(self.ticks))
        ]
        self.times = [
            {w: self.g.worker_time(w, es, t, self.made, self.floors[t]) for w, es in tick.items()}
            for t, tick in enumerate(self.ticks)
        ]

    def _lengths(self, t: int, w: Worker, time: float) -> tuple[float, float]:
        """Tick t's length as `simulator.simulate.packed_events` prices it, now and
        with worker w's time in it changed to `time`."""
        times = self.times[t]
        others = max((x for u, x in times.items() if u != w), default=0.0)
        return max(others, times.get(w, 0.0)), max(others, time)

    def _try(self, w: Worker, entry: Entry, t: int) -> bool:
        it, op = entry
        if op.kind not in COMPUTE_KINDS:
            return False
        here, there = self.ticks[t], self.ticks[t + 1]
        mine = here.get(w, [])
        if any(o.kind is Kind.OPT for _, o in mine):
            return False
        joined = lane_order([*mine, entry], self.g.order)
        ops = [o for _, o in joined]
        if not fits(ops, self.g.order, self.g.w_per_tick) or not self._ready(w, entry, t, joined):
            return False
        rest = [e for e in there[w] if e != entry]
        joined_time = self.g.worker_time(w, joined, t, self.made, self.floors[t])
        rest_time = self.g.worker_time(w, rest, t + 1, self.made, self.floors[t + 1])
        here_now, here_then = self._lengths(t, w, joined_time)
        there_now, there_then = self._lengths(t + 1, w, rest_time)
        before, after = here_now + there_now, here_then + there_then
        if not rest and not any(es for u, es in there.items() if u != w):
            after -= self.g.costs.tick  # tick t + 1 empties and goes, with its fixed cost
        if after >= before - 1e-9 or not self._memory_ok(w, t, joined, rest):
            return False
        here[w], there[w] = joined, rest
        self.times[t][w], self.times[t + 1][w] = joined_time, rest_time
        for k in self.g.produces[(w, op)]:
            self.made[(it, k)] = t
        return True

    def _ready(self, w: Worker, entry: Entry, t: int, joined: list[Entry]) -> bool:
        """Whether `entry` may run in tick t: the iteration's barrier (or, staggered,
        its stage's OPT) is behind it, each message was made before t, and each
        residual earlier in t on this worker."""
        it, op = entry
        if it > 0:
            if self.g.sched.staggered:
                if self.opt_tick.get((op.stage, it - 1), -1) >= t:
                    return False
            elif self.last_opt.get(it - 1, -1) >= t:
                return False
        earlier = {
            (it, k)
            for jt, o in joined[: joined.index(entry)]
            if jt == it
            for k in self.g.produces[(w, o)]
        }
        for key, message in self.g.deps[(w, op)]:
            made = self.made.get((it, key), t + 1)
            if made > t or (made == t and (message or (it, key) not in earlier)):
                return False
        return True

    def _memory_ok(self, w: Worker, t: int, joined: list[Entry], rest: list[Entry]) -> bool:
        """Whether worker w stays within the greedy's memory bound with `joined` in
        tick t and `rest` in tick t + 1."""
        total = peak = (0, 0, 0)
        for u, tick in enumerate(self.ticks):
            for _, o in joined if u == t else rest if u == t + 1 else tick.get(w, []):
                total = add(total, self.g.delta[o])
                peak = highest(peak, total)
        return self.g.bound.admits(peak)
