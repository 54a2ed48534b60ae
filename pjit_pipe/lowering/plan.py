"""The tick plan: a schedule's lockstep table as per-device integer rows.

The SPMD program scans over ticks; on each tick every device reads one row of
its own table: which branch to run (idle, or F/B/W/BW of one virtual stage),
the microbatch, and the buffer slots it reads and writes. Slots are assigned
here, on the host, by interval allocation over the tick timeline, so buffers
are sized by the schedule's in-flight peak and not by the number of
microbatches. Messages (activations going down, input gradients going up)
leave a device in the tick that makes them and land in a slot of the
receiver's message store at the end of that tick. Each ppermute carries one
(replica, position) shift of the worker grid, so it is a permutation even when
re-routed microbatches cross replicas; a device sends at most one message per
tick, along every shift the schedule uses.

Devices are the live workers in a given order (`Topology.workers`): row i of
every table belongs to worker i. Each device also gets its own list of the
(replica, microbatch) inputs and labels it reads, so a peer running another
replica's microbatches is fed that replica's data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pjit_pipe.ir.lockstep import iteration_ticks
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError

KIND_ORDER = (Kind.F, Kind.B, Kind.W, Kind.BW)


class TickRow(NamedTuple):
    """What one device does in one tick, as a pytree of int32 arrays.

    In a `TickPlan` each field has a leading (devices, ticks) shape; inside the
    program `lax.scan` walks the ticks and each field is a scalar (`recv` a
    vector). Slot fields index the device's message or residual store; the
    store's size is its scratch slot (a write there is discarded, a read there
    is never used).
    """

    branch: Any  # 0 idles; i >= 1 runs `TickPlan.branches[i - 1]`
    mb: Any  # row of the device's input list (`TickPlan.inputs`) the op reads
    in_slot: Any  # message slot of the op's input activation
    g_slot: Any  # message slot of the op's output gradient (B, W, BW)
    res_w: Any  # residual slot F writes
    res_r: Any  # residual slot B, W, BW read (B also writes its cotangents there)
    self_slot: Any  # message slot where this device keeps a message to itself
    iteration: Any  # the op's iteration (multi-iteration programs)
    update: Any  # bit c set: chunk c takes its optimizer step after this tick
    recv: Any  # per shift (`TickPlan.shifts` order), the slot the received message lands in


@dataclass(frozen=True)
class TickPlan:
    """Per-device tick rows plus the buffer sizes they index into.

    rows: the tick rows, each field of shape (devices, ticks) (`recv`:
        (devices, ticks, shifts)). A message slot equal to the store size is
        the scratch slot: writes there are discarded (every tick stores what
        it receives). Residual slots are read only by the ops that use them.
    inputs: int32 (devices, L, 3), the (iteration, replica, microbatch)
        triples whose input or label each device reads; `rows.mb` indexes
        this list.
    msg_slots / res_slots: message store size (scratch excluded), residual store size.
    shifts: for each ppermute, the (replica, position) shift and its
        (source, dest) pairs of device indices.
    branches: the (kind, virtual stage) of branch 1, 2, ...; branch 0 idles.
        Only pairs the schedule uses get a branch (each one is compiled).
    """

    rows: TickRow
    inputs: np.ndarray
    msg_slots: int
    res_slots: int
    shifts: tuple[tuple[tuple[int, int], tuple[tuple[int, int], ...]], ...]
    branches: tuple[tuple[Kind, int], ...]
    updates: np.ndarray  # bool (ticks,): some stage steps its optimizer after this tick

    @property
    def ticks(self) -> int:
        return self.rows.branch.shape[1]


class _Slots:
    """Interval allocation: a slot is busy from its write tick through its last read."""

    def __init__(self) -> None:
        self.free_from: list[int] = []

    def take(self, write_tick: int, last_read: int) -> int:
        for i, t in enumerate(self.free_from):
            if t <= write_tick:
                self.free_from[i] = last_read
                return i
        self.free_from.append(last_read)
        return len(self.free_from) - 1


def build_plan(
    schedule: Schedule,
    remat: bool,
    devices: Sequence[Worker],
    iterations: int = 1,
    every_stage_reads: bool = False,
) -> TickPlan:
    """Assign ticks, branches and buffer slots; `devices` are the live workers in row order.

    With `every_stage_reads`, every stage's ops index the device's input list
    (per-microbatch random keys), not only the first and last stage's.

    With several iterations, microbatch j of iteration k is planned as
    microbatch k*m + j, and each stage's optimizer step is placed right after
    the tick of its last W/BW of the iteration (its gradients are complete then);
    in an asynchronous schedule, right after each of its W/BW (one step per microbatch).
    """
    S, m = schedule.num_virtual_stages, schedule.microbatches
    D, P = schedule.replicas, schedule.stages
    index = {w: i for i, w in enumerate(devices)}
    if set(index) != set(schedule.alive_workers):
        raise ScheduleError(
            f"devices {sorted(index)} are not the schedule's live workers {schedule.alive_workers}"
        )
    ticks = [
        {
            w: op._replace(mb=it * m + op.mb)
            for w, (it, op) in tick.items()
            if op.kind in COMPUTE_KINDS
        }
        for tick in iteration_ticks(schedule, iterations)
    ]
    ticks = [t for t in ticks if t]
    when: dict[Op, tuple[Worker, int]] = {}
    for t, tick in enumerate(ticks):
        for w, op in tick.items():
            when[op] = (w, t)

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

    shift_pairs: dict[tuple[int, int], set[tuple[int, int]]] = {}
    for _, src, _, dest, _ in messages:
        if src != dest:
            shift_pairs.setdefault(shift(src, dest), set()).add((index[src], index[dest]))
    shifts = tuple((k, tuple(sorted(v))) for k, v in sorted(shift_pairs.items()))
    shift_index = {k: i for i, (k, _) in enumerate(shifts)}

    msg_alloc = {w: _Slots() for w in devices}
    res_alloc = {w: _Slots() for w in devices}
    msg_slot: dict[tuple[Kind, int, int, int], int] = {}
    arrivals: list[tuple[Worker, int, int | None, int]] = []  # (dest, tick, shift, slot)
    for op, src, t, dest, last in sorted(messages, key=lambda m: m[2]):
        slot = msg_alloc[dest].take(t, last)
        key = ("act" if op.kind is Kind.F else "grad", op.stage, op.mb, op.replica)
        msg_slot[key] = slot
        via = None if src == dest else shift_index[shift(src, dest)]
        arrivals.append((dest, t, via, slot))

    res_slot: dict[tuple[int, int, int], int] = {}
    if not remat:
        for op, (w, t) in sorted(when.items(), key=lambda kv: kv[1][1]):
            if op.kind is Kind.F:
                _, last = last_use((Kind.W, Kind.BW), op.stage, op.mb, op.replica)
                res_slot[(op.stage, op.mb, op.replica)] = res_alloc[w].take(t, last)

    K = max((len(a.free_from) for a in msg_alloc.values()), default=0)
    R = max((len(a.free_from) for a in res_alloc.values()), default=0)
    # Each device's inputs: the (iteration, replica, microbatch) its first and
    # last virtual stages read, in order of first use.
    local: dict[Worker, dict[tuple[int, int], int]] = {w: {} for w in devices}
    for tick in ticks:
        for w, op in tick.items():
            if every_stage_reads or op.stage in (0, S - 1):
                local[w].setdefault((op.replica, op.mb), len(local[w]))
    inputs = np.zeros((len(devices), max(1, *map(len, local.values())), 3), np.int32)
    for w, pairs in local.items():
        for (r, j), i in pairs.items():
            inputs[index[w], i] = (j // m, r, j % m)

    last_grad: dict[tuple[int, int], int] = {}  # (stage, step) -> tick of its last W/BW
    per_microbatch = schedule.asynchronous
    for op, (_, t) in when.items():
        if op.kind in (Kind.W, Kind.BW):
            key = (op.stage, op.mb if per_microbatch else op.mb // m)
            last_grad[key] = max(t, last_grad.get(key, t))

    branches = sorted(
        {(op.kind, op.stage) for tick in ticks for op in tick.values()},
        key=lambda ks: (ks[1], KIND_ORDER.index(ks[0])),
    )
    branch = {ks: 1 + i for i, ks in enumerate(branches)}
    n, T = len(devices), len(ticks)
    col = {f: np.zeros((n, T), np.int32) for f in TickRow._fields if f != "recv"}
    col["recv"] = np.full((n, T, len(shifts)), K, np.int32)
    for f in ("in_slot", "g_slot", "self_slot"):
        col[f][:] = K
    for f in ("res_w", "res_r"):
        col[f][:] = R
    for t, tick in enumerate(ticks):
        for w, op in tick.items():
            d = index[w]
            col["branch"][d, t] = branch[(op.kind, op.stage)]
            col["mb"][d, t] = local[w].get((op.replica, op.mb), 0)
            key = (op.stage, op.mb, op.replica)
            col["in_slot"][d, t] = msg_slot.get(("act", op.stage - 1, op.mb, op.replica), K)
            col["g_slot"][d, t] = msg_slot.get(("grad", op.stage + 1, op.mb, op.replica), K)
            col["res_w" if op.kind is Kind.F else "res_r"][d, t] = res_slot.get(key, R)
            col["iteration"][d, t] = op.mb // m
    for dest, t, via, slot in arrivals:
        if via is None:
            col["self_slot"][index[dest], t] = slot
        else:
            col["recv"][index[dest], t, via] = slot
    updates = np.zeros(T, bool)
    for (s, _), t in last_grad.items():
        updates[t] = True
        for w in devices:
            if w.stage == schedule.layout[s]:
                col["update"][index[w], t] |= 1 << schedule.chunk_of(s)
    return TickPlan(
        rows=TickRow(**col),
        inputs=inputs,
        msg_slots=K,
        res_slots=R,
        shifts=shifts,
        branches=tuple(branches),
        updates=updates,
    )
