"""Two prices of one tick table, one per way a runtime synchronizes its ticks.

The compiled tick loop ends each tick with the ppermutes of its messages
(lowering/comms/delivery.py). How long a device then waits depends on the runtime:

- global lockstep (`"global"`, `TickPricer.events`): every tick starts when
  the slowest device has finished the one before. One CPU process is like
  this: its collectives meet in a rendezvous of every device of the program.
- neighbour-synchronous (`"neighbor"`, `TickTimeline.events`): a device
  waits only for the devices it exchanges with in the tick: the senders and
  receivers of its messages, and the replicas it reduces a stage's gradients
  with (an OPT of several replicas), one meeting after another in program
  order (`TickTimeline`). A collective-permute across processes is a
  send/recv between the pairs that exchange (gloo on CPU, NCCL on GPUs), so
  one controller per device runs like this when each tick's ppermutes name
  only its real pairs (`lowering.plan.build_plan(pairwise=True)`).

Both read one device's own tick the same way (`WorkerTick`): its ops one
after another, an op that reads a late message (a deferred table,
ir/ticks.py) no earlier than C into the tick, the tick at least C long where
a late message lands, and C after its last op that sends at once. Under
global lockstep a tick lasts its longest device's; neighbour-synchronous, a
device's tick starts once it has left the meetings of the tick before, and a
late message's pair meets at the start of the next tick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pjit_pipe.ir.engine import TimedOp
from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.ticks import PackedTicks, fused_loss_ops, sends_late

Sync = Literal["global", "neighbor"]
SYNCS: tuple[Sync, ...] = ("global", "neighbor")


@dataclass(frozen=True)
class PlannedOp:
    """One op of a device's tick: its duration, whether it first waits for a late
    message (C from the tick's start) and whether it sends a message at once."""

    iteration: int
    op: Op
    duration: float
    reads_late: bool
    sends_now: bool


@dataclass(frozen=True)
class WorkerTick:
    """One device's share of one tick: its ops in run order, the least length a
    landing late message gives the tick (C or 0), and the device's own length."""

    ops: tuple[PlannedOp, ...]
    floor: float
    length: float


class TickTimeline:
    """Per tick, each device's `WorkerTick` and the meetings that end it.

    A meeting is a tuple of devices that leave it together, when the last of
    them arrives: a ppermute pair (the lowering's `pairwise` plan gives each
    message pair its own ppermute, and a send/recv waits for both ends), or
    the replicas of a stage that reduce its gradients at an OPT. A device
    meets them in program order: at the tick's end the activation pairs, then
    the gradient pairs (each channel's in device order), then the reductions;
    a deferred table's late pairs at the next tick's start.

    `pricer` is a `simulator.simulate.TickPricer` of the table's schedule: its
    per-op durations and messages are read here, not rebuilt."""

    def __init__(self, pricer, table: PackedTicks):
        self.pricer, self.table = pricer, table
        c = pricer.costs.c
        readers: dict = {}
        for (w, _), keys in pricer.reads.items():
            for key in keys:
                readers.setdefault(key, set()).add(w)
        workers = pricer.schedule.alive_workers
        rank = {w: i for i, w in enumerate(workers)}
        self.ticks: list[dict[Worker, WorkerTick]] = []
        self.meetings: list[list[tuple[Worker, ...]]] = []  # at each tick's end
        self.late_meetings: list[list[tuple[Worker, ...]]] = []  # at the next tick's start
        landing: dict[Worker, set] = {}  # late (iteration, key)s landing in this tick
        for tick in table.ticks:
            pairs: dict[tuple[bool, bool], set[tuple[Worker, Worker]]] = {}  # (late, act)
            made: dict[Worker, set] = {}
            shares = {}
            groups: dict[tuple[int, int, int], list[Worker]] = {}
            for w in workers:
                entries = tick.get(w, ())
                fused = fused_loss_ops(entries, pricer.loss_stage) if pricer.fusion != 1.0 else ()
                mine = landing.get(w, set())
                ops, busy, length = [], 0.0, c if mine else 0.0
                for it, op in entries:
                    if op.kind is Kind.OPT:
                        groups.setdefault((op.stage, it, op.mb), []).append(w)
                        continue
                    reads_late = any((it, k) in mine for k in pricer.reads[(w, op)])
                    if reads_late:
                        busy = max(busy, c)
                    d = pricer.duration[(w, op)] * (pricer.fusion if (it, op) in fused else 1.0)
                    busy += d
                    sent = pricer.sends[(w, op)]
                    deferred = table.deferred and sends_late(op.kind, table.order)
                    for key in sent:
                        for r in readers.get(key, ()):
                            if r != w:
                                pairs.setdefault((deferred, op.kind is Kind.F), set()).add((w, r))
                                if deferred:
                                    made.setdefault(r, set()).add((it, key))
                    if sent and not deferred:
                        length = max(length, busy + c)
                    ops.append(PlannedOp(it, op, d, reads_late, bool(sent) and not deferred))
                    length = max(length, busy)
                shares[w] = WorkerTick(tuple(ops), c if mine else 0.0, length)

            def ordered(late: bool, pairs=pairs) -> list[tuple[Worker, ...]]:
                return [
                    pair
                    for act in (True, False)
                    for pair in sorted(
                        pairs.get((late, act), ()), key=lambda p: (rank[p[0]], rank[p[1]])
                    )
                ]

            reductions = [
                tuple(g)
                for key, g in sorted(
                    groups.items(), key=lambda kv: pricer.schedule.chunk_of(kv[0][0])
                )
                if len(g) > 1
            ]
            self.ticks.append(shares)
            self.meetings.append(ordered(False) + reductions)
            self.late_meetings.append(ordered(True))
            landing = made

    def events(self, sync: Sync) -> list[TimedOp]:
        """The ops' times when the runtime synchronizes ticks as `sync` says."""
        tick_cost = self.pricer.costs.tick
        workers = self.pricer.schedule.alive_workers
        end = dict.fromkeys(workers, 0.0)
        events: list[TimedOp] = []
        for k, shares in enumerate(self.ticks):
            if sync == "global":
                begin = max(end.values()) + tick_cost
                start = dict.fromkeys(workers, begin)
            else:
                if k:
                    end = _meet(end, self.meetings[k - 1])
                    end = _meet(end, self.late_meetings[k - 1])
                start = {w: end[w] + tick_cost for w in workers}
            for w, share in shares.items():
                busy = 0.0
                for p in share.ops:
                    if p.reads_late:
                        busy = max(busy, share.floor)
                    t = start[w] + busy
                    index = self.pricer.index[(w, p.op)]
                    events.append(TimedOp(w, index, p.iteration, p.op, t, t + p.duration))
                    busy += p.duration
                end[w] = start[w] + share.length
            if sync == "global":  # the tick lasts its longest device's
                longest = max(end.values())
                end = dict.fromkeys(workers, longest)
        return events


def _meet(ready: dict[Worker, float], meetings: list[tuple[Worker, ...]]) -> dict[Worker, float]:
    """When each device leaves `meetings`, run in order, having arrived at `ready`."""
    ready = dict(ready)
    for group in meetings:
        t = max(ready[w] for w in group)
        for w in group:
            ready[w] = t
    return ready


def sync_time(pricer, table: PackedTicks, sync: Sync) -> float:
    """The time the compiled tick loop takes to run `table` under `sync`."""
    if sync == "global":
        return pricer.time(table)
    return max((e.end for e in TickTimeline(pricer, table).events(sync)), default=0.0)


def check_sync(sync: str) -> Sync:
    """`sync` if it names a way of synchronizing ticks, else a one-line error."""
    if sync not in SYNCS:
        raise ScheduleError(
            f"sync must be one of {', '.join(SYNCS)} (global: every device waits for all "
            f"at each tick; neighbor: only for the devices it exchanges with), got {sync!r}"
        )
    return sync
