"""Lockstep (tick-synchronous) form of a schedule: what an SPMD program executes.

Every worker advances at most one compute op per tick, and a tensor produced in
tick t can be used from tick t+1 (it travels between ticks). The lowering
compiles exactly this table; the simulator prices it to show what lockstep costs.
SEND/RECV ops are dropped: communication happens between every pair of ticks.
"""

from __future__ import annotations

from pjit_pipe.ir.dataflow import Dataflow, DeadlockError
from pjit_pipe.ir.ops import COMM_KINDS, Op, Worker
from pjit_pipe.ir.schedule import Schedule

TickTable = list[dict[Worker, Op]]


def tick_table(schedule: Schedule) -> TickTable:
    """The ops each worker runs in each tick (a worker missing from a tick idles)."""
    compute_only = schedule.replace(
        programs={
            w: [op for op in p if op.kind not in COMM_KINDS] for w, p in schedule.programs.items()
        }
    )
    flow = Dataflow(compute_only)
    progs = {w: compute_only.program(w) for w in compute_only.alive_workers}
    deps = {w: [[k for k, _ in flow.deps(w, op)] for op in ops] for w, ops in progs.items()}
    ptr = dict.fromkeys(progs, 0)
    counts: dict[tuple, int] = {}
    ready: set[tuple] = set()
    ticks: TickTable = []
    remaining = sum(len(p) for p in progs.values())
    while remaining:
        tick = {}
        for w, ops in progs.items():
            i = ptr[w]
            if i < len(ops) and all(k in ready for k in deps[w][i]):
                tick[w] = ops[i]
        if not tick:
            stuck = ", ".join(f"{w}: {progs[w][ptr[w]]}" for w in progs if ptr[w] < len(progs[w]))
            raise DeadlockError(f"deadlock in lockstep execution at tick {len(ticks)}: {stuck}")
        for w, op in tick.items():
            ptr[w] += 1
            remaining -= 1
            for k in flow.produces(w, op):
                counts[k] = counts.get(k, 0) + 1
                if counts[k] == flow.aggregate_size(k):
                    ready.add(k)
        ticks.append(tick)
    return ticks
