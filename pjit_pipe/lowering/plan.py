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

import numpy as np

from pjit_pipe.ir.lockstep import iteration_ticks
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError

KIND_ORDER = (Kind.F, Kind.B, Kind.W, Kind.BW)

# Columns of a tick row. ITER: the op's iteration; UPDATE: bit c set when this
# device's chunk c takes its optimizer step after this tick.
BRANCH, MB, IN_SLOT, G_SLOT, RES_W, RES_R, SELF_SLOT, ITER, UPDATE = range(9)
RECV0 = 9  # one column per shift, in `TickPlan.shifts` order


@dataclass(frozen=True)
class TickPlan:
    """Per-device tick rows plus the buffer sizes they index into.

    rows: int32 (devices, ticks, columns). A message slot equal to the
        store size is the scratch slot: writes there are discarded (every
        tick stores what it receives). Residual slots are read only by the
        ops that use them.
    inputs: int32 (devices, L, 3), the (iteration, replica, microbatch)
        triples whose input or label each device reads; column MB of a row
        indexes this list.
    msg_slots / res_slots: message store size (scratch excluded), residual store size.
    shifts: for each ppermute, the (replica, position) shift and its
        (source, dest) pairs of device indices.
    branches: the (kind, virtual stage) of branch 1, 2, ...; branch 0 idles.
        Only pairs the schedule uses get a branch (each one is compiled).
    """

    rows: np.ndarray
    inputs: np.ndarray
    msg_slots: int
    res_slots: int
    shifts: tuple[tuple[tuple[int, int], tuple[tuple[int, int], ...]], ...]
    branches: tuple[tuple[Kind, int], ...]
    updates: np.ndarray  # bool (ticks,): some stage steps its optimizer after this tick

    @property
    def ticks(self) -> int:
        return self.rows.shape[1]


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
    shift_col = {k: RECV0 + i for i, (k, _) in enumerate(shifts)}

    msg_alloc = {w: _Slots() for w in devices}
    res_alloc = {w: _Slots() for w in devices}
    msg_slot: dict[tuple[Kind, int, int, int], int] = {}
    arrivals: list[tuple[Worker, int, int, int]] = []  # (dest, tick, column, slot)
    for op, src, t, dest, last in sorted(messages, key=lambda m: m[2]):
        slot = msg_alloc[dest].take(t, last)
        key = ("act" if op.kind is Kind.F else "grad", op.stage, op.mb, op.replica)
        msg_slot[key] = slot
        col = SELF_SLOT if src == dest else shift_col[shift(src, dest)]
        arrivals.append((dest, t, col, slot))

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
    rows = np.zeros((len(devices), len(ticks), RECV0 + len(shifts)), np.int32)
    rows[..., [IN_SLOT, G_SLOT, SELF_SLOT]] = K
    rows[..., RECV0:] = K
    rows[..., [RES_W, RES_R]] = R
    for t, tick in enumerate(ticks):
        for w, op in tick.items():
            row = rows[index[w], t]
            row[BRANCH] = branch[(op.kind, op.stage)]
            row[MB] = local[w].get((op.replica, op.mb), 0)
            key = (op.stage, op.mb, op.replica)
            row[IN_SLOT] = msg_slot.get(("act", op.stage - 1, op.mb, op.replica), K)
            row[G_SLOT] = msg_slot.get(("grad", op.stage + 1, op.mb, op.replica), K)
            if op.kind is Kind.F:
                row[RES_W] = res_slot.get(key, R)
            else:
                row[RES_R] = res_slot.get(key, R)
            row[ITER] = op.mb // m
    for dest, t, col, slot in arrivals:
        rows[index[dest], t, col] = slot
    updates = np.zeros(len(ticks), bool)
    for (s, _), t in last_grad.items():
        updates[t] = True
        for w in devices:
            if w.stage == schedule.layout[s]:
                rows[index[w], t, UPDATE] |= 1 << schedule.chunk_of(s)
    return TickPlan(
        rows=rows,
        inputs=inputs,
        msg_slots=K,
        res_slots=R,
        shifts=shifts,
        branches=tuple(branches),
        updates=updates,
    )
