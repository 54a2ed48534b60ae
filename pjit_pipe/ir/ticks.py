"""The packed tick table: what the compiled SPMD program runs, tick by tick.

The lowering compiles a loop of ticks. In one tick each worker runs a short
ordered tuple of ops, then every message made in the tick travels, so a
tensor produced in tick t is usable from tick t+1, on any worker (its own
included). The simulator prices this same table (`mode="lockstep"`), and
`tick_packing/packer.py` builds it.

The rule for one worker's ops in one tick (`fits`). An op occupies lanes:
F the activation lane (it sends an activation down), B the gradient lane (it
sends an input gradient up), W the accumulation lane (it adds into a
parameter gradient) and BW both the gradient and the accumulation lanes. A
table runs its lanes in one fixed order, its `order`, and a tick holds a
worker's ops in increasing lane position in that order: at most one F, one B
and `W_PER_TICK` W's (or one F and one BW). Why this rule:
- each lane is one conditional of the tick body writing one store (the W
  lane one per W it holds), so a tick costs a fixed few conditionals however
  it is packed;
- a tick sends at most one activation and one gradient per worker, the two
  message channels (nothing queues behind anything); a W sends nothing, so
  a second one costs no channel. It is what lets the last stage keep up
  after its last B: the gradient then crosses the other stages one B per
  tick while it has only W's left, and with one W per tick each of those
  ticks would cost B - W more than its work (simulator.bounds);
- a same-tick dependency must run earlier in the order: a dependency on a
  message (another stage's output) needs an earlier tick, even from the same
  worker; one on the worker's own residuals an earlier lane of the tick.

Two orders exist, and `pack_ticks` keeps whichever table is cheaper:
- F, B, W (`FORWARD_FIRST`) is the order of one stage and microbatch's local
  dependencies, so F(s,j), B(s,j), W(s,j) may share a tick (the last stage's
  forward and backward of one microbatch in one tick, which the lowering then
  runs as one op: `fused_loss_ops`), and F's message leaves
  first, its transfer overlapping the tick's B and W;
- B, W, F (`FORWARD_LAST`) frees before it allocates: "B(j), W(j), F(j+k)"
  never holds more than the worker held before the tick, where F, B, W peaks
  one microbatch above it before B and W free theirs. Within a memory limit
  (the schedule's own peak, the default) that is often the difference
  between packing a steady-state tick and not; but the last stage's F(j) and
  B(j) need two ticks, and F's transfer is no longer hidden behind the tick.

A table may run a worker's ops in another order than its program (a younger
op ahead of one that waits for a message), never past one of its OPTs; its
activation memory is then `peak_memory()`, not the schedule's.

When a message travels (`PackedTicks.deferred`). By default both channels
leave in the tick that fills them: a message leaves when its op ends, its
transfer overlapping the worker's later lanes, and the tick ends once it has
arrived. So a tick whose last sending op ends last pays the transfer time C.
A deferred table sends the channel its first lane does not read (`late_channel`:
the gradients under F, B, W; the activations under B, W, F) at the start of
the next tick instead: the transfer then overlaps the receiver's first lane,
and only the op that reads the message waits for it. Which is cheaper
depends on the table (the packer prices both); a message made in tick t is
usable from tick t+1 either way.

An OPT entry follows the tick's compute ops: the optimizer step runs at the
end of the tick, once every W/BW of its stage and iteration ran in that tick
or earlier, and the OPTs of one stage and iteration (one per replica) share
the tick (their gradient reduction is one collective). The stage's ops of
the next iteration run in later ticks. Without staggering no worker starts
iteration k+1 before the tick after the last OPT of iteration k.

An asynchronous schedule (per-microbatch OPTs) has an OPT per stage and
microbatch, at the end of the tick of that microbatch's last W/BW of the
stage; its table runs each worker's ops in exactly its overlapping stream
order (`engine.stream_order`): which weights a forward reads depends on which
OPTs came before it, so no op may move past another.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pjit_pipe.ir.engine import Engine, Key, MicrobatchGrads, StageGrads, Tensor, stream_order
from pjit_pipe.ir.lockstep import iteration_ticks
from pjit_pipe.ir.ops import COMM_KINDS, COMPUTE_KINDS, Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError

Entry = tuple[int, Op]  # (iteration, op)
Tick = Mapping[Worker, tuple[Entry, ...]]

LaneOrder = tuple[Kind, Kind, Kind]  # the order a table runs its F, B and W lanes in
W_PER_TICK = 2  # the W's one worker may run in one tick (in its W lane, one after the other)
FORWARD_FIRST: LaneOrder = (Kind.F, Kind.B, Kind.W)
FORWARD_LAST: LaneOrder = (Kind.B, Kind.W, Kind.F)
LANE_ORDERS = (FORWARD_FIRST, FORWARD_LAST)


@functools.cache  # the packer asks millions of times
def lanes(kind: Kind, order: LaneOrder = FORWARD_FIRST) -> tuple[int, ...]:
    """The positions in `order` of the lanes a compute kind occupies (BW: B's and W's,
    adjacent in every order)."""
    if kind is Kind.BW:
        return (order.index(Kind.B), order.index(Kind.W))
    return (order.index(kind),)


def late_channel(order: LaneOrder) -> Kind:
    """The kind whose messages a deferred table sends at the start of the next tick:
    the channel the first lane does not read (F: activations, made by F; B:
    input gradients, made by B, BW and a fused loss-stage group)."""
    return Kind.B if order[0] is Kind.F else Kind.F


def sends_late(kind: Kind, order: LaneOrder) -> bool:
    """Whether a message made by an op of `kind` is on `order`'s late channel."""
    return (kind is Kind.F) == (late_channel(order) is Kind.F)


def fits(ops: Sequence[Op], order: LaneOrder = FORWARD_FIRST, w_per_tick: int = W_PER_TICK) -> bool:
    """Whether one worker may run these ops, in this order, in one tick of a table
    whose lane order is `order` (with at most `w_per_tick` W's)."""
    lane = -1
    ws = 0  # W's in a row in the W lane so far
    compute_done = False
    for op in ops:
        if op.kind is Kind.OPT:
            compute_done = True
            continue
        if compute_done or op.kind not in COMPUTE_KINDS:
            return False
        taken = lanes(op.kind, order)
        if op.kind is Kind.W and ws and ws < w_per_tick:
            ws += 1  # another W in the W lane (never after a BW: ws counts W's only)
            continue
        if taken[0] <= lane:
            return False
        lane = taken[-1]
        ws = 1 if op.kind is Kind.W else 0
    return True


def lane_order(entries: Sequence[Entry], order: LaneOrder = FORWARD_FIRST) -> list[Entry]:
    """A worker's compute entries of one tick in the order they run."""
    return sorted(entries, key=lambda e: lanes(e[1].kind, order)[0])


def fused_loss_ops(entries: Sequence[Entry], loss_stage: int) -> frozenset[Entry]:
    """The entries of one worker's tick that run as one program: each microbatch
    whose forward and whole backward (BW, or B and W) on the loss stage (the last
    virtual stage, `loss_stage`) are all in the tick. Only F, B, W's lane order
    lets them share a tick. The lowering runs such a group as one
    `value_and_grad`-shaped op in the W lane (lowering/tick_plan.py), which stores no
    residual, and the lockstep price scales the group by `Costs.loss_fusion`."""
    backward: dict[tuple[int, int, int], set[Kind]] = {}
    for it, op in entries:
        if op.stage == loss_stage and op.kind in COMPUTE_KINDS:
            backward.setdefault((it, op.mb, op.replica), set()).add(op.kind)
    whole = {
        key
        for key, kinds in backward.items()
        if Kind.F in kinds and (Kind.BW in kinds or {Kind.B, Kind.W} <= kinds)
    }
    if not whole:
        return frozenset()
    return frozenset(
        (it, op)
        for it, op in entries
        if op.stage == loss_stage and op.kind in COMPUTE_KINDS and (it, op.mb, op.replica) in whole
    )


def compute_only(schedule: Schedule) -> Schedule:
    """The schedule without SEND/RECV: in a tick table every message travels between ticks."""
    if not schedule.has_comm():
        return schedule
    return schedule.replace(
        programs={
            w: [op for op in p if op.kind not in COMM_KINDS] for w, p in schedule.programs.items()
        }
    )


def is_message(key: Key, op: Op) -> bool:
    """Whether `op`'s dependency `key` is a message (another stage's output: it must
    come from an earlier tick) rather than its own stage's residual (same tick allowed)."""
    return isinstance(key, Tensor) and key.stage != op.stage


@dataclass(frozen=True)
class PackedTicks:
    """A schedule run for `iterations` back-to-back iterations as a tick table.

    ticks[t][w]: the (iteration, op) entries worker w runs in tick t, in the
    order they run (a worker missing from a tick idles). Compute ops and OPTs
    only. order: the lane order every tick runs its ops in; deferred: whether the
    late channel's messages leave at the start of the next tick (module docstring).
    """

    schedule: Schedule
    iterations: int
    ticks: tuple[Tick, ...]
    order: LaneOrder = FORWARD_FIRST
    deferred: bool = False

    def __len__(self) -> int:
        return len(self.ticks)

    @classmethod
    def one_op_per_tick(cls, schedule: Schedule, iterations: int = 1) -> PackedTicks:
        """The unpacked table: each worker runs at most one compute op per tick, as
        early as its dependencies allow (ir/lockstep.py); each OPT runs at the end of
        the tick of its stage's last W/BW of the iteration (asynchronous: of the
        microbatch; lockstep.py runs those OPTs between ticks, not in the table)."""
        ticks: list[dict[Worker, tuple[Entry, ...]]] = []
        asynchronous = schedule.asynchronous
        last_grad: dict[tuple[int, int, int], int] = {}  # (stage, iteration, mb or -1) -> tick
        opts: dict[tuple[int, int, int], list[tuple[Worker, Entry]]] = {}
        for tick in iteration_ticks(compute_only(schedule), iterations):
            kept = {}
            for w, (it, op) in tick.items():
                if op.kind is Kind.OPT:
                    opts.setdefault((op.stage, it, op.mb), []).append((w, (it, op)))
                    continue
                kept[w] = ((it, op),)
                if op.kind in (Kind.W, Kind.BW):
                    last_grad[(op.stage, it, op.mb if asynchronous else -1)] = len(ticks)
            if kept:
                ticks.append(kept)
        if asynchronous:
            for w in schedule.alive_workers:
                for it in range(iterations):
                    for op in schedule.program(w):
                        if op.kind is Kind.OPT:
                            opts.setdefault((op.stage, it, op.mb), []).append((w, (it, op)))
        for key, entries in opts.items():
            tick = ticks[last_grad[key]]
            for w, e in entries:
                tick[w] = (*tick.get(w, ()), e)
        return cls(schedule, iterations, tuple(ticks))

    def first_iteration(self) -> PackedTicks:
        """The table of iteration 0 alone (later iterations' entries dropped, empty ticks too)."""
        ticks = []
        for tick in self.ticks:
            kept = {w: tuple(e for e in es if e[0] == 0) for w, es in tick.items()}
            kept = {w: es for w, es in kept.items() if es}
            if kept:
                ticks.append(kept)
        return PackedTicks(self.schedule, 1, tuple(ticks), self.order, self.deferred)

    def fused_ops(self) -> frozenset[tuple[Worker, int, Op]]:
        """(worker, iteration, op) of every op the lowering runs in a fused loss-stage
        group (`fused_loss_ops`, tick by tick)."""
        last = self.schedule.num_virtual_stages - 1
        return frozenset(
            (w, it, op)
            for tick in self.ticks
            for w, entries in tick.items()
            for it, op in fused_loss_ops(entries, last)
        )

    def fused_groups(self) -> int:
        """How many loss-stage groups the table runs as one op (one F each)."""
        return sum(op.kind is Kind.F for _, _, op in self.fused_ops())

    def placement(self) -> dict[tuple[Worker, int, Op], tuple[int, int]]:
        """(worker, iteration, op) -> (tick, position within the worker's tuple)."""
        return {
            (w, it, op): (t, i)
            for t, tick in enumerate(self.ticks)
            for w, entries in tick.items()
            for i, (it, op) in enumerate(entries)
        }

    def check(self) -> None:
        """Raise ScheduleError unless the table runs the schedule by the module's rule."""
        sched = compute_only(self.schedule)
        flow = Engine(sched)
        where = self.placement()
        for t, tick in enumerate(self.ticks):
            for w, entries in tick.items():
                if not fits([op for _, op in entries], self.order):
                    order = ", ".join(self.order)
                    raise ScheduleError(
                        f"tick {t}, worker {w}: {entries} breaks the lane rule (order {order})"
                    )
        opt_end: dict[int, int] = {}
        opt_ticks: dict[tuple[int, int, int], set[int]] = {}  # (stage, iteration, mb or -1)
        producers: dict[tuple, list[tuple[int, int, Worker]]] = {}
        for (w, it, op), (t, i) in where.items():
            for key in flow.produces(w, op):
                producers.setdefault((it, key), []).append((t, i, w))
            if op.kind is Kind.OPT:
                opt_end[it] = max(opt_end.get(it, -1), t)
                opt_ticks.setdefault((op.stage, it, op.mb), set()).add(t)
        for (s, it, j), ticks in opt_ticks.items():
            if len(ticks) > 1:
                of = f"stage {s}, iteration {it}" + (f", microbatch {j}" if j >= 0 else "")
                raise ScheduleError(f"the OPTs of {of} are in ticks {ticks}")
        for w in sched.alive_workers:
            got = sorted(e for tick in self.ticks for e in tick.get(w, ()))
            want = sorted((it, op) for it in range(self.iterations) for op in sched.program(w))
            if got != want:
                raise ScheduleError(f"worker {w}: the table does not run each op once")
            if flow.asynchronous:
                program = sched.program(w)
                stream = [
                    (it, program[i]) for it, i in stream_order(program, self.iterations, True)
                ]
                run = [e for tick in self.ticks for e in tick.get(w, ())]
                if run != stream:
                    raise ScheduleError(
                        f"worker {w}: an asynchronous table must run the worker's ops in "
                        "their stream order (engine.stream_order)"
                    )
        for (w, it, op), (t, i) in where.items():
            if op.kind is not Kind.OPT and not flow.asynchronous:
                stepped = opt_ticks.get((op.stage, it - 1, -1), {-1})
                if it > 0 and t <= max(stepped):
                    raise ScheduleError(f"{op} of iteration {it} on {w} runs before OPT{op.stage}")
                if it > 0 and not sched.staggered and t <= opt_end.get(it - 1, -1):
                    raise ScheduleError(f"{op} on {w} starts iteration {it} before its barrier")
            for key, _ in flow.deps(w, op):
                for pt, pi, pw in producers.get((it, key), ()):
                    if isinstance(key, StageGrads | MicrobatchGrads):
                        bad = pt > t
                    elif is_message(key, op):
                        bad = pt >= t
                    else:  # its own stage's residual: same worker, earlier in the tick
                        bad = pw != w or (pt, pi) >= (t, i)
                    if bad:
                        raise ScheduleError(
                            f"tick {t}: {op} on {w} needs {key} from tick {pt} on {pw}"
                        )

    def peak_memory(self) -> dict[Worker, float]:
        """Each worker's peak in-flight activation memory running the table, in the
        units of ir/memory.py (a packed table may reorder a worker's ops)."""
        sched, out = self.schedule, {}
        delta = {Kind.F: 2, Kind.B: -1, Kind.W: -1, Kind.BW: -2}
        for w in sched.workers:
            total = peak = 0
            for tick in self.ticks:
                for _, op in tick.get(w, ()):
                    total += delta.get(op.kind, 0)
                    peak = max(peak, total)
            out[w] = peak / (2 * sched.chunks)
        return out
