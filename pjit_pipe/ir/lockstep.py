"""Lockstep (tick-synchronous) form of a schedule: what an SPMD program executes.

Every worker advances at most one compute op per tick, and a tensor produced in
tick t can be used from tick t+1 (it travels between ticks). This is the
unpacked table (`ir.ticks.PackedTicks.one_op_per_tick`); the lowering compiles
the packed one that tick_packing/packer.py builds, when it is given one.
SEND/RECV ops are dropped: communication happens between every pair of ticks.
"""

from __future__ import annotations

from pjit_pipe.ir.engine import DeadlockError, Engine, Key, Stamped, stream_order
from pjit_pipe.ir.ops import COMM_KINDS, Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule

TickTable = list[dict[Worker, Op]]
IterationTicks = list[dict[Worker, tuple[int, Op]]]


def _step_between_ticks(
    progs: dict[Worker, list[Op]],
    order: dict[Worker, list[tuple[int, int]]],
    deps: dict[Worker, list[list[Key]]],
    ptr: dict[Worker, int],
    ready: set[Stamped],
) -> int:
    """Run every asynchronous OPT whose gradients are ready (between two ticks); return how
    many. What an OPT produces matters only to an iteration barrier, which an asynchronous
    schedule does not have."""
    stepped = 0
    for w, ops in progs.items():
        while ptr[w] < len(order[w]):
            it, i = order[w][ptr[w]]
            if ops[i].kind is not Kind.OPT or not all((it, k) in ready for k in deps[w][i]):
                break
            ptr[w] += 1
            stepped += 1
    return stepped


def tick_table(schedule: Schedule) -> TickTable:
    """The ops each worker runs in each tick of one iteration (missing: idle)."""
    return [{w: op for w, (_, op) in tick.items()} for tick in iteration_ticks(schedule, 1)]


def iteration_ticks(schedule: Schedule, iterations: int) -> IterationTicks:
    """(iteration, op) per worker per tick over back-to-back iterations.

    Between iterations the dataflow's rule holds: unless the schedule is
    staggered, nobody starts iteration k+1 before every OPT of iteration k;
    staggered, a worker goes on right after its own OPTs. An asynchronous
    schedule runs each worker's overlapping stream (`engine.stream_order`), and
    its per-microbatch OPTs take no tick of their own: they run between ticks
    (so they are not in the table).
    """
    compute_only = schedule.replace(
        programs={
            w: [op for op in p if op.kind not in COMM_KINDS] for w, p in schedule.programs.items()
        }
    )
    flow = Engine(compute_only)
    progs = {w: compute_only.program(w) for w in compute_only.alive_workers}
    deps = {w: [[k for k, _ in flow.deps(w, op)] for op in ops] for w, ops in progs.items()}
    asynchronous = flow.asynchronous
    order = {w: stream_order(ops, iterations, asynchronous) for w, ops in progs.items()}
    ptr = dict.fromkeys(progs, 0)
    counts: dict[Stamped, int] = {}
    ready: set[Stamped] = set()
    ticks: IterationTicks = []
    remaining = sum(len(p) for p in progs.values()) * iterations
    while remaining:
        stepped = _step_between_ticks(progs, order, deps, ptr, ready) if asynchronous else 0
        remaining -= stepped
        tick = {}
        for w, ops in progs.items():
            if ptr[w] == len(ops) * iterations:
                continue
            it, i = order[w][ptr[w]]
            wait = [(it, k) for k in deps[w][i]]
            if (barrier := flow.barrier(it, i)) is not None:
                wait.append(barrier)
            if (ops[i].kind is not Kind.OPT or not asynchronous) and all(k in ready for k in wait):
                tick[w] = (it, ops[i])
        if not tick and (stepped or not remaining):
            continue
        if not tick:
            stuck = ", ".join(
                f"{w}: {progs[w][order[w][ptr[w]][1]]}"
                for w in progs
                if ptr[w] < len(progs[w]) * iterations
            )
            raise DeadlockError(f"deadlock in lockstep execution at tick {len(ticks)}: {stuck}")
        for w, (it, op) in tick.items():
            ptr[w] += 1
            remaining -= 1
            for k in flow.produces(w, op):
                key = (it, k)
                counts[key] = counts.get(key, 0) + 1
                if counts[key] == flow.aggregate_size(k):
                    ready.add(key)
        ticks.append(tick)
    return ticks
