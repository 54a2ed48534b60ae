"""Price a schedule under a cost model: makespan, span, bubbles, memory, steady period."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import DurationFn, Engine, LatencyFn, TimedOp
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import Kind, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import PackedTicks, compute_only, fused_loss_ops, sends_late
from pjit_pipe.simulator.tick_sync import TickTimeline, check_sync

Mode = Literal["event", "lockstep"]


@dataclass
class SimResult:
    """Figures of one simulated schedule (units of docs/design.md section 3)."""

    makespan: float
    span: float
    ideal: float
    bubble_ratio: float
    peak_memory: dict[Worker, float]
    busy: dict[Worker, float]
    worker_span: dict[Worker, float]
    steady_period: float
    iterations: int
    mode: Mode
    events: list[TimedOp] = field(repr=False)

    def worker_bubble(self, w: Worker) -> float:
        return 1.0 - self.busy[w] / self.worker_span[w] if self.worker_span[w] else 0.0

    def summary(self) -> dict:
        """The JSON-ready figures the CLI prints."""
        return {
            "makespan": round(self.makespan, 9),
            "span": round(self.span, 9),
            "ideal": round(self.ideal, 9),
            "bubble_ratio": round(self.bubble_ratio, 9),
            "peak_memory": [self.peak_memory[w] for w in sorted(self.peak_memory)],
            "busy": [round(self.busy[w], 9) for w in sorted(self.busy)],
            "steady_period": round(self.steady_period, 9),
            "iterations": self.iterations,
            "mode": self.mode,
        }


class TickPricer:
    """Prices tick tables of one schedule under one cost model, as the compiled tick
    loop runs them (`events`).

    In a tick each worker runs its ops one after another; a message to another
    worker leaves when its op ends and takes C (it overlaps the worker's later
    ops in the tick: the ppermute of a channel depends only on the op that
    fills it). The tick ends when the slowest worker is done and every
    message has arrived; the next tick starts then. In a deferred table
    (ir/ticks.py) the late channel's messages leave at the start of the next
    tick instead: that tick lasts at least C (it ends when they have landed,
    read or not), and an op that reads one starts no earlier than C into it.
    Every tick
    first pays `costs.tick`, the fixed cost of one step of the loop (its
    conditionals and ppermute launches, ir/costs.py), whether its workers are
    busy or not, so a table of n ticks costs n * tick more than its tick
    lengths add up to.
    A microbatch's loss-stage forward and backward that share a tick run as one
    program (`ir.ticks.fused_loss_ops`), their ops scaled by `costs.loss_fusion`.

    `sync="neighbor"` makes `time` price neighbour-synchronous ticks instead
    (tick_sync.py: a device waits only for the devices it exchanges with), the
    price the packer then packs for; `events` is always global lockstep.

    What every pricing reads (each op's duration, the messages it reads from
    and sends to other workers) is built once: the packer prices a hundred
    candidate tables of one schedule.
    """

    def __init__(self, schedule: Schedule, costs: Costs, sync: str = "global"):
        self.schedule, self.costs = schedule, costs
        self.sync = check_sync(sync)  # what `time` prices (tick_sync.py)
        sched = compute_only(schedule)
        duration = costs.duration_fn(sched)
        self.fusion, self.loss_stage = costs.loss_fusion(sched), sched.num_virtual_stages - 1
        flow = Engine(sched)
        crosses = {key for w, _, op in sched.ops() for key, cross in flow.deps(w, op) if cross}
        # Per (worker, op): its place in the worker's program, its duration, the
        # messages it reads from another worker and those it sends to one.
        self.index = {
            (w, op): i for w in sched.alive_workers for i, op in enumerate(sched.program(w))
        }
        self.duration = {(w, op): duration(w, op) for w, _, op in sched.ops()}
        self.reads = {
            (w, op): [key for key, cross in flow.deps(w, op) if cross] for w, _, op in sched.ops()
        }
        self.sends = {
            (w, op): [k for k in flow.produces(w, op) if k in crosses] for w, _, op in sched.ops()
        }

    def events(self, table: PackedTicks) -> list[TimedOp]:
        """Events of the compiled tick loop running `table` (a table of this
        pricer's schedule)."""
        if table.schedule is not self.schedule and table.schedule != self.schedule:
            raise ScheduleError("TickPricer: the table is of another schedule than the pricer's")
        costs, c = self.costs, self.costs.c
        events, t = [], 0.0
        in_flight: set = set()  # (iteration, key): late messages made in the tick before
        for tick in table.ticks:
            t += costs.tick
            length = c if in_flight else 0.0
            made = set()
            for w, entries in tick.items():
                busy = 0.0
                fused = fused_loss_ops(entries, self.loss_stage) if self.fusion != 1.0 else ()
                for it, op in entries:
                    if in_flight and any((it, key) in in_flight for key in self.reads[(w, op)]):
                        busy = max(busy, c)
                    d = self.duration[(w, op)] * (self.fusion if (it, op) in fused else 1.0)
                    events.append(TimedOp(w, self.index[(w, op)], it, op, t + busy, t + busy + d))
                    busy += d
                    sent = self.sends[(w, op)]
                    if sent and table.deferred and sends_late(op.kind, table.order):
                        made.update((it, k) for k in sent)
                    elif sent:
                        length = max(length, busy + c)
                length = max(length, busy)
            t += length
            in_flight = made
        return events

    def time(self, table: PackedTicks) -> float:
        """The time the compiled tick loop takes to run the whole table, its ticks
        synchronized as the pricer's `sync` says (tick_sync.py)."""
        events = self.events(table) if self.sync == "global" else self.timeline(table)
        return max((e.end for e in events), default=0.0)

    def timeline(self, table: PackedTicks) -> list[TimedOp]:
        """The events of `table` under neighbour-synchronous ticks (tick_sync.py)."""
        return TickTimeline(self, table).events("neighbor")


def packed_events(table: PackedTicks, costs: Costs) -> list[TimedOp]:
    """Events of the compiled tick loop running `table` (`TickPricer.events`)."""
    return TickPricer(table.schedule, costs).events(table)


def packed_time(table: PackedTicks, costs: Costs) -> float:
    """The time the compiled tick loop takes to run the whole table."""
    return TickPricer(table.schedule, costs).time(table)


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    iterations: int = 1,
    mode: Mode = "event",
    *,
    duration: DurationFn | None = None,
    latency: LatencyFn | None = None,
    ticks: PackedTicks | None = None,
    sync: str = "global",
) -> SimResult:
    """Execute `schedule` for `iterations` iterations and measure it.

    mode="event": every op starts as soon as its worker is free and its inputs
    have arrived (asynchronous execution, what a runtime with streams achieves).
    mode="lockstep": the tick table the lowering compiles, as its SPMD program runs
    it (`packed_events`): `ticks` (built by tick_packing/packer.py for `iterations`
    iterations), else one op per worker per tick (ir/ticks.py), its ticks
    synchronized as `sync` says: "global" (a tick waits for every device) or
    "neighbor" (a device waits only for those it exchanges with; tick_sync.py).
    Makespan, span and busy time are of the first iteration; steady_period is
    (end of the last iteration - end of the first) / (iterations - 1).
    In event mode `duration(worker, op)` and `latency(src, dst)` replace the
    times `costs` gives (per-device speeds, per-link transfer times C).
    """
    costs = costs or Costs()
    if iterations < 1:
        raise ScheduleError(f"iterations must be >= 1, got {iterations}")
    if mode == "event":
        events = Engine(schedule).run(
            duration or costs.duration_fn(schedule),
            latency or (lambda a, b: costs.c),
            iterations=iterations,
        )
    elif mode == "lockstep":
        if duration or latency:
            raise ScheduleError("duration and latency overrides apply to mode='event' only")
        if ticks is None:
            ticks = PackedTicks.one_op_per_tick(schedule, iterations)
        elif ticks.iterations != iterations or ticks.schedule != schedule:
            raise ScheduleError(
                f"ticks: a table of {ticks.iterations} iteration(s) of another schedule was "
                f"given for {iterations} of this one; pack this schedule with iterations="
                f"{iterations}"
            )
        if check_sync(sync) == "global":
            events = packed_events(ticks, costs)
        else:
            events = TickPricer(schedule, costs).timeline(ticks)
    else:
        raise ScheduleError(f"mode must be 'event' or 'lockstep', got {mode!r}")

    first = [e for e in events if e.iteration == 0 and e.op.kind not in (Kind.SEND, Kind.RECV)]
    first = first or [e for e in events if e.iteration == 0]
    makespan = max(e.end for e in first) - min(e.start for e in first)
    busy = dict.fromkeys(schedule.alive_workers, 0.0)
    lo: dict[Worker, float] = {}
    hi: dict[Worker, float] = {}
    for e in first:
        busy[e.worker] += e.end - e.start
        lo[e.worker] = min(lo.get(e.worker, e.start), e.start)
        hi[e.worker] = max(hi.get(e.worker, e.end), e.end)
    worker_span = {w: hi.get(w, 0.0) - lo.get(w, 0.0) for w in busy}
    ends = [0.0] * iterations
    for e in events:
        ends[e.iteration] = max(ends[e.iteration], e.end)
    steady = (ends[-1] - ends[0]) / (iterations - 1) if iterations > 1 else makespan
    ideal = costs.ideal(schedule)
    return SimResult(
        makespan=makespan,
        span=max(worker_span.values()),
        ideal=ideal,
        bubble_ratio=1.0 - ideal / makespan if makespan else 0.0,
        peak_memory=peak_memory(schedule),
        busy=busy,
        worker_span=worker_span,
        steady_period=steady,
        iterations=iterations,
        mode=mode,
        events=events,
    )


STEADY_ITERATIONS = 6


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
