"""The compile path: schedule request -> schedule -> passes -> tick table -> program.

One module (`build.py`) owns the chain, so every caller builds the same thing
the same way: `Pipelined` (the Python API), `pjit-pipe schedule`, the planner
and the benchmarks.
"""

from pjit_pipe.compiler.build import (
    ScheduleSpec,
    build_program,
    build_schedule,
    build_table,
    chunks_of,
    layout_of,
)

__all__ = [
    "ScheduleSpec",
    "build_program",
    "build_schedule",
    "build_table",
    "chunks_of",
    "layout_of",
]
