"""Lockstep (tick-synchronous) form of a schedule: what an SPMD program executes.

Every worker advances at most one compute op per tick, and a tensor produced in
tick t can be used from tick t+1 (it travels between ticks). This is the
unpacked table (`ir.ticks.PackedTicks.one_op_per_tick`); the lowering compiles
the packed one that passes/pack_ticks.py builds, when it is given one.
SEND/RECV ops are dropped: communication happens between every pair of ticks.
"""

from __future__ import annotations

from pjit_pipe.ir.engine import DeadlockError, Engine, Stamped
from pjit_pipe.ir.ops import COMM_KINDS, Op, Worker
from pjit_pipe.ir.schedule import Schedule

TickTable = list[dict[Worker, Op]]
IterationTicks = list[dict[Worker, tuple[int, Op]]]


def tick_table(schedule: Schedule) -> TickTable:
    """The ops each worker runs in each tick of one iteration (missing: idle)."""
    return [{w: op for w, (_, op) in tick.items()} for tick in iteration_ticks(schedule, 1)]


def iteration_ticks(schedule: Schedule, iterations: int) -> IterationTicks:
    """(iteration, op) per worker per tick over back-to-back iterations.

    Between iterations the dataflow's rule holds: unless the schedule is
    staggered, nobody starts iteration k+1 before every OPT of iteration k;
    staggered, a worker goes on right after its own OPTs.
    """
    compute_only = schedule.replace(
        programs={
            w: [op for op in p if op.kind not in COMM_KINDS] for w, p in schedule.programs.items()
        }
    )
    flow = Engine(compute_only)
    progs = {w: compute_only.program(w) for w in compute_only.alive_workers}
    deps = {w: [[k for k, _ in flow.deps(w, op)] for op in ops] for w, ops in progs.items()}
    ptr = dict.fromkeys(progs, 0)
    counts: dict[Stamped, int] = {}
    ready: set[Stamped] = set()
    ticks: IterationTicks = []
    remaining = sum(len(p) for p in progs.values()) * iterations
    while remaining:
        tick = {}
        for w, ops in progs.items():
            if ptr[w] == len(ops) * iterations:
                continue
            it, i = divmod(ptr[w], len(ops))
            wait = [(it, k) for k in deps[w][i]]
            if (barrier := flow.barrier(it, i)) is not None:
                wait.append(barrier)
            if all(k in ready for k in wait):
                tick[w] = (it, ops[i])
        if not tick:
            stuck = ", ".join(
                f"{w}: {progs[w][ptr[w] % len(progs[w])]}"
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
