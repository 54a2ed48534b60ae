"""Tick packing: a schedule's per-worker programs as the tick table the lowering compiles.

The entry point is `pack_ticks`; the rest is how it packs (a greedy, a local
search, an exact MILP for small tables) and what it prices."""

from pjit_pipe.tick_packing.packer import pack_ticks

__all__ = [
    "pack_ticks",
]
