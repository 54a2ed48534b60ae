"""A CPU executable's temporaries kept on the heap, not mapped afresh on every run.

XLA:CPU allocates the temporaries of each run of an executable as one block
(`memory_analysis().temp_size_in_bytes`) and frees it when the run ends.
glibc's malloc serves a block over its mmap threshold with a fresh `mmap` and
unmaps it on free, so the kernel zeroes every page of it on first touch, on
every run: about 0.3 ms a MiB on the CPUs measured. glibc raises the threshold
by itself to the largest block freed so far, but never past 32 MiB
(DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), so a larger block pays on every step.

A pipelined step needs more temporaries than a plain step of the same model:
the loop holds each chunk's parameters in size classes (layout/param_layout.py)
next to the gradient. On the d256 GPT-2 of benchmarks/bench_models.py its
block is 39 MiB against the plain step's 27 MiB, and the page faults alone
cost it about a quarter of a plain step (docs/performance.md).

`keep_on_heap(compiled)` does past the cap what glibc does below it: when a
CPU executable's block is over 32 MiB it raises the mmap threshold above the
block, the trim threshold to twice that (glibc's own ratio) and the top pad
to it (so that a thread arena's heap that held the block is not unmapped when
it empties), and the freed block stays on the heap for the next run. It only
ever raises them, acts on glibc alone (elsewhere it does nothing), and
`PJIT_PIPE_HOST_HEAP=0` in the environment turns it off. The cost is the one
glibc accepts below 32 MiB: memory freed at the end of a step is kept for
the next one.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import jax

# glibc's largest dynamic mmap threshold on 64-bit: below it glibc keeps blocks itself.
GLIBC_DYNAMIC_CAP = 32 << 20
# mallopt parameters (malloc.h); mallopt takes a C int.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_INT_MAX = 2**31 - 1
ENV_SWITCH = "PJIT_PIPE_HOST_HEAP"

_lock = threading.Lock()
_threshold = 0  # the mmap threshold this module last set, in bytes (0: none yet)


def heap_threshold(temp_bytes: int) -> int | None:
    """The mmap threshold that keeps a block of `temp_bytes` on the heap: the next
    power of two above it (room for the slightly larger blocks of a failure
    variant, at most what mallopt takes); None where glibc's own rule already
    keeps it, or no threshold can."""
    if temp_bytes <= GLIBC_DYNAMIC_CAP or temp_bytes >= _INT_MAX:
        return None
    return min(1 << int(temp_bytes).bit_length(), _INT_MAX)


def current_threshold() -> int | None:
    """The mmap threshold `keep_on_heap` has set in this process, if any."""
    return _threshold or None


def _glibc() -> Any:
    """The C library when it is glibc (it has `mallopt`), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        return libc
    except (OSError, AttributeError):
        return None


def keep_on_heap(compiled: Any) -> int | None:
    """Raise glibc's thresholds so `compiled`'s temporaries stay on the heap
    between runs (module docstring). Returns the mmap threshold now in force
    when this call or an earlier one set it, else None (not a CPU executable,
    a block glibc keeps itself, not glibc, or switched off)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    devices = {d for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set}
    if not devices or any(d.platform != "cpu" for d in devices):
        return None
    analysis = compiled.memory_analysis()
    want = heap_threshold(getattr(analysis, "temp_size_in_bytes", 0) or 0)
    global _threshold
    with _lock:
        if want is None or want <= _threshold:
            return _threshold or None
        libc = _glibc()
        if libc is None or not libc.mallopt(_M_MMAP_THRESHOLD, want):
            return None
        libc.mallopt(_M_TRIM_THRESHOLD, min(2 * want, _INT_MAX))
        libc.mallopt(_M_TOP_PAD, want)
        _threshold = want
        return want
