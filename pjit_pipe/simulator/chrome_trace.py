"""Chrome trace event format of a simulation, for chrome://tracing and ui.perfetto.dev.

One process per replica and one thread (track) per worker; each executed op is
a complete event ("ph": "X"). One simulated time unit is written as one
microsecond, the format's unit, so the trace shows the simulator's numbers as is.
"""

from __future__ import annotations

from typing import Any

from pjit_pipe.ir.ops import format_op
from pjit_pipe.simulator.simulate import SimResult


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """The trace as a JSON-ready dict ({"traceEvents": [...], ...})."""
    workers = sorted({e.worker for e in result.events} | set(result.busy))
    meta: list[dict[str, Any]] = []
    for r in sorted({w.replica for w in workers}):
        meta.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"replica {r}"}})
    for w in workers:
        meta.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": w.replica,
                "tid": w.stage,
                "args": {"name": f"worker {w}"},
            }
        )
    ops = [
        {
            "ph": "X",
            "name": format_op(e.op, home_replica=e.worker.replica),
            "cat": e.op.kind.value,
            "pid": e.worker.replica,
            "tid": e.worker.stage,
            "ts": e.start,
            "dur": e.end - e.start,
            "args": {
                "iteration": e.iteration,
                "stage": e.op.stage,
                "mb": e.op.mb,
                "replica": e.op.replica,
                "index": e.index,
            },
        }
        for e in result.events
    ]
    return {
        "traceEvents": meta + ops,
        "otherData": {"time_unit": "1 simulated cost unit = 1 us", "mode": result.mode},
    }
