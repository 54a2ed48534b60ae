"""The tick plan: a packed tick table (ir/ticks.py) as per-device integer rows.

The SPMD program scans over ticks; on each tick every device reads one row
of its own table. A row has one `OpRow` per lane (F, B, W/BW, and a second W: a
tick runs at most one F, one B and two W's, in the table's lane order,
ir/ticks.py): which branch
to run (idle, or F/B/W/BW of one virtual stage), the microbatch, and the
buffer slots it reads and writes. Slots are assigned here, on the host, by
interval allocation over the tick timeline, so buffers are sized by the
in-flight peak and not by the number of microbatches. Stored values sit in
two residual pools with their own slots (stages.py): a split stage's B-pool
row lives from F to B, and W-pool rows live from F to the stage's last
backward op (W or BW), so B frees what only B reads. Messages travel on two
channels, activations (made by F) and input gradients (made by B or BW):
each leaves its device in the tick that makes it and lands in a slot of the
receiver's message store at the end of that tick, except the late channel of
a deferred table (ir/ticks.py), which waits in the sender's outbox row and
lands at the start of the next tick (the row of that tick names its slots). Each ppermute carries one
channel along one (replica, position) shift of the worker grid when that
needs no more ppermutes, so it is a permutation even when re-routed
microbatches cross replicas; otherwise the pairs are split into the fewest
partial permutations, none with a cycle, or one pair each (routes.py).

Devices are the live workers in a given order (`Topology.workers`): row i of
every table belongs to worker i. Each device also gets its own list of the
(replica, microbatch) inputs and labels it reads, so a peer running another
replica's microbatches is fed that replica's data.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Op, Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.ticks import LaneOrder, PackedTicks, sends_late
from pjit_pipe.lowering.comms.routes import Route, channel_routes, gated_sends

# The branch kind of a loss-stage microbatch's F and whole backward run as one op
# (ir.ticks.fused_loss_ops): in the W lane, storing no residual.
FUSED = "F+BW"
BranchKind = Kind | str  # an IR compute kind, or FUSED
KIND_ORDER = (Kind.F, Kind.B, Kind.W, Kind.BW, FUSED)


class OpRow(NamedTuple):
    """One lane's op in one tick, as int32 arrays (scalars inside the scan). Slot
    fields index the device's message or residual store; the store's size is its
    scratch slot (a write there is discarded, a read there is never used)."""

    branch: Any  # 0 idles; i >= 1 runs `TickPlan.branches[i - 1]`
    mb: Any  # row of the device's input list (`TickPlan.inputs`) the op reads
    in_slot: Any  # message slot of the op's input activation
    g_slot: Any  # message slot of the op's output gradient (B, W, BW)
    res_w: Any  # W-pool slot F writes (lives to the stage's last backward op)
    res_r: Any  # W-pool slot B (a split stage's cotangents), W and BW use
    bres_w: Any  # B-pool slot F writes (a split stage's vjp residuals)
    bres_r: Any  # B-pool slot B and BW read
    iteration: Any  # the op's iteration (multi-iteration programs)


class TickRow(NamedTuple):
    """What one device does in one tick: a pytree of int32 arrays, with a leading
    (devices, ticks) shape in a `TickPlan` (`lax.scan` walks the ticks)."""

    f: OpRow  # the F lane
    b: OpRow  # the B lane
    w: OpRow  # the W lane (W or BW)
    w2: OpRow  # the W lane's second W, run after the first (ir.ticks.W_PER_TICK)
    self_act: Any  # message slot where an activation this device sends itself lands
    self_grad: Any  # the same for a gradient
    recv_act: Any  # per activation shift (`TickPlan.act_shifts`), the slot its message lands in
    recv_grad: Any  # per gradient shift (`TickPlan.grad_shifts`), the same
    update: Any  # bit c set: chunk c takes its optimizer step after this tick
    sends: Any  # which of `TickPlan.sends` this tick runs (the same on every device)


LANE_OF = {Kind.F: "f", Kind.B: "b", Kind.W: "w", Kind.BW: "w", FUSED: "w"}
# Per ppermute of a channel: (the (replica, position) shifts its pairs make, its pairs).
Shifts = tuple[tuple[tuple[tuple[int, int], ...], Route], ...]


def _shifts_of(route: Route, devices: Sequence[Worker], shift: Any) -> tuple[tuple[int, int], ...]:
    return tuple(sorted({shift(devices[s], devices[d]) for s, d in route}))


@dataclass(frozen=True)
class TickPlan:
    """Per-device tick rows plus the buffer sizes they index into.

    rows: the tick rows, each field of shape (devices, ticks) (`recv_*`:
        (devices, ticks, shifts of the channel)). A message slot equal to the
        store size is the scratch slot: writes there are discarded (every
        tick stores what it receives). Residual slots are read only by the
        ops that use them.
    inputs: int32 (devices, L, 3), the (iteration, replica, microbatch)
        triples whose input or label each device reads; `rows.mb` indexes
        this list.
    msg_slots / res_slots / bres_slots: message store size (scratch
        excluded), W-pool and B-pool residual store sizes.
    deferred: the late channel (ir.ticks.late_channel of `order`) leaves at
        the start of the next tick: the message store has an outbox row after
        its scratch slot, `outbox`, which holds the late message the tick made.
    act_shifts / grad_shifts: for each ppermute of the activation / gradient
        channel, the (replica, position) shifts its pairs make and its (source,
        dest) pairs of device indices: the fewest ppermutes (routes.py), one
        per shift when that is as few.
    branches: the (kind, virtual stage) of branch 1, 2, ...; branch 0 idles.
        Only pairs the table uses get a branch (each one is compiled); the
        kind FUSED is a loss-stage F and backward run as one op.
    """

    rows: TickRow
    inputs: np.ndarray
    msg_slots: int
    res_slots: int
    bres_slots: int
    act_shifts: Shifts
    grad_shifts: Shifts
    branches: tuple[tuple[BranchKind, int], ...]
    order: LaneOrder  # the order the tick body runs its lanes in (the table's)
    # int32 (ticks,): which of `steppers` steps after this tick (0: none), the same on
    # every device, so the collectives of the gradient reduction run everywhere or
    # nowhere; steppers: each set of (pipeline position, chunk) pairs some tick steps.
    updates: np.ndarray
    steppers: tuple[frozenset[tuple[int, int]], ...]
    # The sets of (activation, gradient) ppermute indices a tick runs; `rows.sends`
    # picks one per tick. One set, every ppermute, unless skipping the idle ones
    # saves at least half of them (see `routes.gated_sends`).
    sends: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    deferred: bool = False

    @property
    def ticks(self) -> int:
        return self.rows.update.shape[1]

    @property
    def outbox(self) -> int:
        """The message store's outbox row (deferred plans; after the scratch slot)."""
        return self.msg_slots + 1

    @property
    def store_rows(self) -> int:
        """Rows of the message store: its slots, the scratch slot and any outbox."""
        return self.msg_slots + 1 + self.deferred


class _Slots:
    """Interval allocation: a slot is busy from its write tick through its last read."""

    def __init__(self) -> None:
        self.free_from: list[int] = []

    def take(self, write_tick: int, last_read: int, strict: bool = False) -> int:
        """A slot free at `write_tick`; `strict`: its last read must be in an earlier
        tick (the writer runs before the tick's readers)."""
        for i, t in enumerate(self.free_from):
            if t < write_tick or (t == write_tick and not strict):
                self.free_from[i] = last_read
                return i
        self.free_from.append(last_read)
        return len(self.free_from) - 1


def build_plan(
    table: PackedTicks,
    remat: bool,
    devices: Sequence[Worker],
    every_stage_reads: bool = False,
    split: Collection[int] = (),
    fuse_loss: bool = False,
    numbering: Sequence[tuple[BranchKind, int]] | None = None,
    pairwise: bool = False,
) -> TickPlan:
    """Assign branches and buffer slots to the ops of `table`; `devices` are the
    live workers in row order; `split` the virtual stages with a split backward
    (their B frees their B-pool slot; every stage's last backward op frees its
    W-pool slot).

    With `every_stage_reads`, every stage's ops index the device's input list
    (per-microbatch random keys), not only the first and last stage's.

    With `fuse_loss`, a loss-stage microbatch whose F and whole backward share a
    tick (ir.ticks.fused_loss_ops) runs as one FUSED op in the W lane, and its F
    gets no residual slot: nothing is stored between them. (An asynchronous
    schedule's F and backward read different weights: it must not fuse.)

    `numbering`: the branches to number the ops by, a superset of those the table
    runs (a multi-iteration plan's, for the plan of its first iteration: two plans
    of one program share its op functions); None numbers just those run.

    `pairwise`: the ppermutes of routes.channel_routes.

    With several iterations, microbatch j of iteration k is planned as
    microbatch k*m + j, and each stage's optimizer step runs after the tick
    of its OPTs in the table (every holder's in one tick); an asynchronous
    schedule's per-microbatch OPTs each place one step.
    """
    schedule = table.schedule
    S, m = schedule.num_virtual_stages, schedule.microbatches
    D, P = schedule.replicas, schedule.stages
    index = {w: i for i, w in enumerate(devices)}
    if set(index) != set(schedule.alive_workers):
        raise ScheduleError(
            f"devices {sorted(index)} are not the schedule's live workers {schedule.alive_workers}"
        )
    when: dict[Op, tuple[Worker, int]] = {}
    # The ops of fused loss-stage groups, microbatches numbered as in `when`.
    fused = (
        {op._replace(mb=it * m + op.mb) for _, it, op in table.fused_ops()} if fuse_loss else set()
    )
    # (stage, iteration, microbatch or -1) -> the ticks of its OPTs
    update_tick: dict[tuple[int, int, int], set[int]] = {}
    for t, tick in enumerate(table.ticks):
        for w, entries in tick.items():
            for it, op in entries:
                if op.kind in COMPUTE_KINDS:
                    when[op._replace(mb=it * m + op.mb)] = (w, t)
                elif op.kind is Kind.OPT:
                    update_tick.setdefault((op.stage, it, op.mb), set()).add(t)
    T = len(table.ticks)

    def last_use(op_kinds: tuple[Kind, ...], stage: int, mb: int, rep: int) -> tuple[Worker, int]:
        found = [when[Op(k, stage, mb, rep)] for k in op_kinds if Op(k, stage, mb, rep) in when]
        return found[0][0], max(t for _, t in found)

    # Every tensor that lands in a message store: (producer op, consumer worker, last read tick).
    messages = []
    for op, (w, t) in when.items():
        if op.kind is Kind.F and op.stage < S - 1:
            reads = (Kind.F, Kind.B, Kind.W, Kind.BW) if remat else (Kind.F,)
            dest, last = last_use(reads, op.stage + 1, op.mb, op.replica)
            messages.append((op, w, t, dest, last))
        elif op.kind in (Kind.B, Kind.BW) and op.stage > 0:
            dest, last = last_use((Kind.B, Kind.W, Kind.BW), op.stage - 1, op.mb, op.replica)
            messages.append((op, w, t, dest, last))

    def shift(src: Worker, dest: Worker) -> tuple[int, int]:
        return (dest.replica - src.replica) % D, (dest.stage - src.stage) % P

    def channel_shifts(act: bool) -> Shifts:
        by_shift: dict[tuple[int, int], set[tuple[int, int]]] = {}
        for op, src, _, dest, _ in messages:
            if src != dest and (op.kind is Kind.F) == act:
                by_shift.setdefault(shift(src, dest), set()).add((index[src], index[dest]))
        grouping = [by_shift[k] for k in sorted(by_shift)]
        routes = channel_routes(grouping, pairwise)
        return tuple((_shifts_of(r, devices, shift), r) for r in routes)

    act_shifts, grad_shifts = channel_shifts(True), channel_shifts(False)
    route_of = {  # (source, dest) device pair -> the index of the ppermute that carries it
        act: {p: i for i, (_, pairs) in enumerate(shifts) for p in pairs}
        for act, shifts in ((True, act_shifts), (False, grad_shifts))
    }

    msg_alloc = {w: _Slots() for w in devices}
    res_alloc = {w: _Slots() for w in devices}
    bres_alloc = {w: _Slots() for w in devices}
    msg_slot: dict[tuple[str, int, int, int], int] = {}
    arrivals: list[tuple[Worker, int, bool, int | None, int]] = []  # dest, tick, act, shift, slot
    for op, src, t, dest, last in sorted(messages, key=lambda m: m[2]):
        slot = msg_alloc[dest].take(t, last)
        act = op.kind is Kind.F
        msg_slot[("act" if act else "grad", op.stage, op.mb, op.replica)] = slot
        via = None if src == dest else route_of[act][(index[src], index[dest])]
        # A late message lands at the start of the next tick (its slot is taken from t).
        late = table.deferred and sends_late(op.kind, table.order)
        arrivals.append((dest, t + late, act, via, slot))

    res_slot: dict[tuple[int, int, int], int] = {}
    bres_slot: dict[tuple[int, int, int], int] = {}
    # F writes residual slots, B, W and BW read them. With F first in the tick a slot
    # read last in tick t is busy through t; with F last, the tick's F may take it.
    strict = table.order[-1] is not Kind.F
    if not remat:
        for op, (w, t) in sorted(when.items(), key=lambda kv: kv[1][1]):
            if op.kind is Kind.F and op not in fused:
                key = (op.stage, op.mb, op.replica)
                _, last = last_use((Kind.B, Kind.W, Kind.BW), *key)
                res_slot[key] = res_alloc[w].take(t, last, strict)
                if op.stage in split:
                    _, last = last_use((Kind.B, Kind.BW), *key)
                    bres_slot[key] = bres_alloc[w].take(t, last, strict)

    K = max((len(a.free_from) for a in msg_alloc.values()), default=0)
    R = max((len(a.free_from) for a in res_alloc.values()), default=0)
    RB = max((len(a.free_from) for a in bres_alloc.values()), default=0)
    # Each device's inputs: the (iteration, replica, microbatch) its first and
    # last virtual stages read, in order of first use.
    local: dict[Worker, dict[tuple[int, int], int]] = {w: {} for w in devices}
    for op, (w, _) in sorted(when.items(), key=lambda kv: kv[1][1]):
        if every_stage_reads or op.stage in (0, S - 1):
            local[w].setdefault((op.replica, op.mb), len(local[w]))
    inputs = np.zeros((len(devices), max(1, *map(len, local.values())), 3), np.int32)
    for w, pairs in local.items():
        for (r, j), i in pairs.items():
            inputs[index[w], i] = (j // m, r, j % m)

    # What each lane runs: a fused group as one FUSED op, at its F's row and first in
    # its W lane (so that a W beside it takes the second W lane).
    runs = [(FUSED, op, w, t) for op, (w, t) in when.items() if op in fused and op.kind is Kind.F]
    runs += [(op.kind, op, w, t) for op, (w, t) in when.items() if op not in fused]
    run = {(kind, op.stage) for kind, op, _, _ in runs}
    if numbering is not None and not run <= set(numbering):
        raise ScheduleError(f"branches {sorted(run - set(numbering))} run but are not numbered")
    branches = numbering or sorted(run, key=lambda ks: (ks[1], KIND_ORDER.index(ks[0])))
    # The pools have a row (a scratch one at least) for a compiled F, B, W or BW to
    # index, even when every op that stores was fused away.
    if not remat and any(kind is not FUSED for kind, _ in branches):
        R, RB = max(R, 1), max(RB, 1 if split else 0)
    branch = {ks: 1 + i for i, ks in enumerate(branches)}
    n = len(devices)
    lanes = {}
    for lane in ("f", "b", "w", "w2"):
        col = {f: np.zeros((n, T), np.int32) for f in OpRow._fields}
        col["in_slot"][:] = K
        col["g_slot"][:] = K
        col["res_w"][:] = R
        col["res_r"][:] = R
        col["bres_w"][:] = RB
        col["bres_r"][:] = RB
        lanes[lane] = col
    for kind, op, w, t in runs:
        d, col = index[w], lanes[LANE_OF[kind]]
        if kind is Kind.W and col["branch"][d, t]:  # the tick's second W
            col = lanes["w2"]
        col["branch"][d, t] = branch[(kind, op.stage)]
        col["mb"][d, t] = local[w].get((op.replica, op.mb), 0)
        col["in_slot"][d, t] = msg_slot.get(("act", op.stage - 1, op.mb, op.replica), K)
        col["g_slot"][d, t] = msg_slot.get(("grad", op.stage + 1, op.mb, op.replica), K)
        key = (op.stage, op.mb, op.replica)
        col["res_w" if op.kind is Kind.F else "res_r"][d, t] = res_slot.get(key, R)
        if op.kind is not Kind.W:  # W reads only the W-pool
            col["bres_w" if op.kind is Kind.F else "bres_r"][d, t] = bres_slot.get(key, RB)
        col["iteration"][d, t] = op.mb // m
    self_slot = {act: np.full((n, T), K, np.int32) for act in (True, False)}
    recv = {
        True: np.full((n, T, len(act_shifts)), K, np.int32),
        False: np.full((n, T, len(grad_shifts)), K, np.int32),
    }
    for dest, t, act, via, slot in arrivals:
        if via is None:
            self_slot[act][index[dest], t] = slot
        else:
            recv[act][index[dest], t, via] = slot
    update = np.zeros((n, T), np.int32)
    for (s, it, j), ticks in update_tick.items():
        if len(ticks) > 1:
            of = f"stage {s} in iteration {it}" + (f", microbatch {j}," if j >= 0 else "")
            raise ScheduleError(
                f"the OPTs of {of} run in ticks {sorted(ticks)}: "
                "a stage's replicas must step in one tick (their gradients are reduced there)"
            )
        (t,) = ticks
        for w in devices:
            if w.stage == schedule.layout[s]:
                update[index[w], t] |= 1 << schedule.chunk_of(s)
    stepping = [
        frozenset(
            (w.stage, c)
            for w in devices
            for c in range(schedule.chunks)
            if update[index[w], t] >> c & 1
        )
        for t in range(T)
    ]
    steppers = (frozenset(), *sorted(set(stepping) - {frozenset()}, key=sorted))
    sends, pick = gated_sends(recv[True] < K, recv[False] < K, always=pairwise)
    rows = TickRow(
        f=OpRow(**lanes["f"]),
        b=OpRow(**lanes["b"]),
        w=OpRow(**lanes["w"]),
        w2=OpRow(**lanes["w2"]),
        self_act=self_slot[True],
        self_grad=self_slot[False],
        recv_act=recv[True],
        recv_grad=recv[False],
        update=update,
        sends=np.broadcast_to(pick, (n, T)).astype(np.int32),
    )
    return TickPlan(
        rows=rows,
        inputs=inputs,
        msg_slots=K,
        res_slots=R,
        bres_slots=RB,
        act_shifts=act_shifts,
        grad_shifts=grad_shifts,
        branches=tuple(branches),
        order=table.order,
        updates=np.array([steppers.index(st) for st in stepping], np.int32),
        steppers=steppers,
        sends=sends,
        deferred=table.deferred,
    )
