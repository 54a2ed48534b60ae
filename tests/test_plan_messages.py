"""The message traffic of a tick plan (lowering/tick_plan.py), run symbolically.

Each message is a label (channel, iteration, stage, microbatch, replica); the
run follows the plan as the compiled tick body does (tick.py, delivery.py):
the lanes read their slots, a deferred plan's late channel arrives at the
start of the next tick and is read through, the ppermutes of the tick's set
(`TickPlan.sends`) carry each device's message along their pairs, and what
lands is written to the slots the row names. Every F then must read its
predecessor stage's activation and every B or BW its successor's gradient,
of its own iteration: for every kind, re-routed and staggered tables, both
lane orders and both send timings, with nothing compiled.
"""

from __future__ import annotations

import dataclasses

import pytest

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import LANE_ORDERS, PackedTicks, late_channel
from pjit_pipe.lowering.tick_plan import TickPlan, build_plan
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import KINDS, make_schedule, schedule_with_failures
from pjit_pipe.tick_packing.packer import pack_ticks

Label = tuple  # (channel "act" / "grad", iteration, stage, microbatch, replica)


def misread(table: PackedTicks, plan: TickPlan | None = None) -> list[str]:
    """Every read of `table` run by `plan` (None: its own) that gets another message
    than its op needs."""
    sched = table.schedule
    devices = tuple(sched.alive_workers)
    plan = plan or build_plan(table, remat=False, devices=devices)
    rows, n, K = plan.rows, len(devices), plan.msg_slots
    index = {w: i for i, w in enumerate(devices)}
    store: list[dict[int, Label]] = [{} for _ in range(n)]
    outbox: list[Label | None] = [None] * n
    acts_late = late_channel(table.order) is Kind.F
    last = sched.num_virtual_stages - 1
    wrong = []
    for t, tick in enumerate(table.ticks):
        which = plan.sends[int(rows.sends[0, t])]
        late: list[list[tuple[int, Label | None]]] = [[] for _ in range(n)]
        if table.deferred:
            late = delivered(plan, t, outbox, acts_late, which)  # the tick before's
        made: dict[bool, list[Label | None]] = {True: [None] * n, False: [None] * n}
        for w, entries in tick.items():
            d = index[w]
            for it, op in entries:
                if op.kind is Kind.F:
                    if op.stage > 0:
                        slot, want = rows.f.in_slot[d, t], ("act", it, op.stage - 1)
                        got = read(store[d], late[d] if acts_late else [], slot)
                        if got != (*want, op.mb, op.replica):
                            wrong.append(f"tick {t} {w} {op} (iteration {it}) read {got}")
                    made[True][d] = ("act", it, op.stage, op.mb, op.replica)
                elif op.kind in (Kind.B, Kind.BW):
                    lane = rows.b if op.kind is Kind.B else rows.w
                    if op.stage < last:
                        slot, want = lane.g_slot[d, t], ("grad", it, op.stage + 1)
                        got = read(store[d], [] if acts_late else late[d], slot)
                        if got != (*want, op.mb, op.replica):
                            wrong.append(f"tick {t} {w} {op} (iteration {it}) read {got}")
                    made[False][d] = ("grad", it, op.stage, op.mb, op.replica)
        for d in range(n):
            write(store[d], late[d], K)
        for act in (True, False):
            if table.deferred and act == acts_late:
                continue
            for d, landed in enumerate(delivered(plan, t, made[act], act, which)):
                write(store[d], landed, K)
        if table.deferred:
            outbox = made[acts_late]
    return wrong


def delivered(plan: TickPlan, t: int, sent: list, act: bool, which) -> list[list]:
    """Per device, (slot, label) of what lands in its store from one channel in tick
    t's row: its own message in its self slot, then each ppermute of `which`."""
    rows = plan.rows
    shifts = plan.act_shifts if act else plan.grad_shifts
    self_slot, recv = (rows.self_act, rows.recv_act) if act else (rows.self_grad, rows.recv_grad)
    run = which[0] if act else which[1]
    landed = [[(int(self_slot[d, t]), sent[d])] for d in range(len(sent))]
    for i, (_, pairs) in enumerate(shifts):
        got = dict.fromkeys(range(len(sent)))
        if i in run:
            got.update({dst: sent[src] for src, dst in pairs})
        for d in range(len(sent)):
            landed[d].append((int(recv[d, t, i]), got[d]))
    return landed


def read(store: dict[int, Label], late: list[tuple[int, Label | None]], slot) -> Label | None:
    got = store.get(int(slot))
    for at, label in late:
        if at == int(slot):
            got = label
    return got


def write(store: dict[int, Label], landed: list[tuple[int, Label | None]], scratch: int) -> None:
    for slot, label in landed:
        if slot != scratch:
            store[slot] = label


COSTS = Costs(1, 2, 1, 1)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "async-1f1b"])
def test_every_kind_reads_the_messages_it_needs(kind):
    chunks = 2 if kind == "interleaved-1f1b" else None
    sched = make_schedule(kind, 4, 8, chunks=chunks, replicas=2)
    for order in LANE_ORDERS:
        table = pack_ticks(sched, COSTS, 2, orders=(order,))
        for deferred in (False, True):
            assert misread(dataclasses.replace(table, deferred=deferred)) == []


@pytest.mark.parametrize("failed", [[(1, 2)], [(0, 1), (1, 3)]], ids=["one", "two"])
@pytest.mark.parametrize("staggered", [False, True], ids=["sync", "staggered"])
def test_rerouted_tables_read_the_messages_they_need(failed, staggered):
    sched = schedule_with_failures("zb-h1", 4, 4, 2, failed, COSTS, time_limit=1.0)
    sched = stagger(sched) if staggered else sched
    for order in LANE_ORDERS:
        table = pack_ticks(sched, COSTS, 2, orders=(order,))
        for deferred in (False, True):
            assert misread(dataclasses.replace(table, deferred=deferred)) == []


def test_the_run_catches_a_plan_that_lands_late_messages_on_time():
    """The check can fail: a deferred table run by the plan of its at-once twin."""
    sched = make_schedule("zb-h1", 4, 6)
    table = dataclasses.replace(pack_ticks(sched, COSTS), deferred=True)
    at_once = build_plan(dataclasses.replace(table, deferred=False), False, sched.workers)
    assert misread(table) == []
    assert misread(table, dataclasses.replace(at_once, deferred=True)) != []


def test_each_tick_steps_the_positions_of_its_opts():
    """`TickPlan.updates` names, per tick, the (position, chunk) pairs whose OPT the
    table runs in that tick: the same index on every device."""
    sched = stagger(schedule_with_failures("zb-h1", 4, 4, 2, [(1, 2)], COSTS, time_limit=1.0))
    table = pack_ticks(sched, COSTS, 2)
    plan = build_plan(table, False, tuple(sched.alive_workers))
    for t, tick in enumerate(table.ticks):
        opts = {
            (w.stage, sched.chunk_of(op.stage))
            for w, entries in tick.items()
            for _, op in entries
            if op.kind is Kind.OPT
        }
        assert plan.steppers[plan.updates[t]] == opts
    assert len(set(plan.updates.tolist()) - {0}) > 1  # staggered: positions step apart
