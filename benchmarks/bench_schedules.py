"""Every schedule generator over a grid of (P, m, costs, memory limit), and auto's speed.

Prints one row per (point, kind): makespan, span, bubble ratio, peak memory and
the time to generate; "-" rows are requests the kind refuses (e.g. a memory
limit below its peak). Ends with the time auto takes at P=32, m=128 (costs
5,6,4,1, limit P), which must stay under 1 s.

Run: python -m benchmarks.bench_schedules
"""

from __future__ import annotations

import time

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.schedules import KINDS, make_schedule
from pjit_pipe.simulator.simulate import simulate

UNIT = Costs()
ZB = Costs(5, 6, 4, 1)
# (P, m, costs name, costs, memory limit as a multiple of P; None: unbounded)
GRID = [
    (4, 8, "1,1,1", UNIT, 1),
    (4, 8, "1,1,1", UNIT, 2),
    (4, 12, "5,6,4,1", ZB, 1),
    (4, 12, "5,6,4,1", ZB, 2),
    (8, 32, "5,6,4,1", ZB, 1),
    (8, 32, "5,6,4,1", ZB, 2),
    (8, 16, "uneven", Costs([1, 1, 2, 2, 1, 1, 3, 1], 2, 1, 0.5), None),
    (16, 64, "1,1,1", UNIT, 1),
]
LARGE = (32, 128)


def _row(kind: str, P: int, m: int, costs: Costs, limit: float | None) -> str:
    start = time.perf_counter()
    try:
        schedule = make_schedule(kind, P, m, costs=costs, mem_limit=limit)
    except ScheduleError:
        return f"  {kind:17} -"
    took = time.perf_counter() - start
    r = simulate(schedule, costs)
    return (
        f"  {kind:17} makespan {r.makespan:8g}  span {r.span:8g}  bubble {r.bubble_ratio:6.1%}"
        f"  peak {max(r.peak_memory.values()):5g}  generate {took * 1000:7.1f} ms"
    )


def time_auto_large(repeats: int = 3) -> float:
    """Best-of-`repeats` seconds for auto at P=32, m=128, costs 5,6,4,1, limit P."""
    P, m = LARGE
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        make_schedule("auto", P, m, costs=ZB, mem_limit=P)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    """Print the table (no options; `argv` keeps the benchmarks' common signature)."""
    for P, m, name, costs, factor in GRID:
        limit = None if factor is None else factor * P
        print(f"P={P} m={m} costs={name} mem_limit={limit if limit is not None else '-'}")
        for kind in KINDS:
            print(_row(kind, P, m, costs, limit))
    took = time_auto_large()
    print(f"auto at P={LARGE[0]} m={LARGE[1]} costs=5,6,4,1 mem_limit={LARGE[0]}: {took:.3f} s")


if __name__ == "__main__":
    main()
