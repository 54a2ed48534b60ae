"""Measure the devices a plan runs on: the N x N ppermute bandwidth matrix, and memory.

The planner prices a transfer from device i to device j as bytes over
bandwidth[i][j] (`pjit_pipe.planner.cost`); the pipeline moves activations with
`lax.ppermute`, so that is what the probe times. Each directed pair is timed
alone (a pair's link is what a plan's neighbours use; timing every device's
send at once would charge a fast pair for the slowest link in its round).

One program per buffer size serves every pair: a `lax.switch` on a replicated
pair index whose branch k ppermutes device i's buffer to device j for the k-th
pair (i, j). Every device takes the same branch, so each collective runs on
all of them or none (docs/design.md section 5). Per pair and size the time is
the median of `repeats` runs; the bandwidth is the slope of a least-squares fit
time = latency + bytes / bandwidth over the sizes, which removes the fixed cost
of a dispatch. Where the fit is not increasing in bytes (tiny buffers, where
the latency hides the transfer: CPU tests), the largest size's bytes over its
time is used instead, a lower bound on the link.

Memory is each device's allocator limit (`memory_stats()["bytes_limit"]`) or,
where the platform reports none (CPU), the host's physical memory shared
evenly by the devices. Speeds are not measured: the devices of one kind run a
layer equally fast, so they are left at 1.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pjit_pipe.planner.devices import Devices, DevicesError

SIZES = (1 << 20, 4 << 20, 16 << 20)  # bytes per transfer: 1, 4 and 16 MiB
CPU_SIZES = (1 << 10, 1 << 14)  # on CPU a "link" is a memcpy: small buffers keep it quick
REPEATS = 5  # timed runs per pair and size; the median counts
AXIS = "probe"


def _pair_program(mesh: Mesh, pairs: list[tuple[int, int]]):
    """One jitted program: branch k moves the sender's buffer of pair k to its receiver."""

    def move(pair: tuple[int, int]):
        return lambda x: lax.ppermute(x, AXIS, [pair])

    branches = [move(pair) for pair in pairs]

    def body(k, x):
        return lax.switch(k[0], branches, x)

    spec = P(AXIS)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), spec), out_specs=spec, check_vma=False)
    )


def _median_time(run, k: np.ndarray, x: jax.Array, repeats: int) -> float:
    run(k, x).block_until_ready()  # warm up: the first run of a branch sets up its channel
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(k, x).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def fit_bandwidth(sizes: Sequence[int], times: Sequence[float]) -> float:
    """bytes/s of time = latency + bytes / bandwidth (see the module docstring)."""
    if len(sizes) > 1:
        slope = np.polyfit(np.asarray(sizes, float), np.asarray(times, float), 1)[0]
        # Flat times fit a slope of rounding noise (1e-23 s/byte, numpy 2.4), not 0:
        # a slope that explains under a millionth of the largest time is flat.
        if slope * max(sizes) > 1e-6 * max(times):
            return float(1 / slope)
    return float(sizes[-1] / max(times[-1], 1e-9))


def _memory(device: jax.Device, share: int) -> float:
    try:
        stats = device.memory_stats() or {}
    except (NotImplementedError, RuntimeError):
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / share)


def probe_devices(
    devices: Sequence[jax.Device] | None = None,
    sizes: Sequence[int] | None = None,
    repeats: int = REPEATS,
) -> Devices:
    """The planner's description of `devices` (default: jax.devices()), measured.

    sizes: bytes per transfer (rounded down to whole float32s, at least one);
    None: SIZES, or CPU_SIZES on CPU. repeats: timed runs per pair and size.
    Compiles one program per size.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise DevicesError("probe: no devices given")
    if sizes is None:
        sizes = CPU_SIZES if devices[0].platform == "cpu" else SIZES
    if not sizes or any(int(s) < 4 for s in sizes):
        raise DevicesError(f"probe: sizes must be byte counts >= 4, got {list(sizes)}")
    if repeats < 1:
        raise DevicesError(f"probe: repeats must be >= 1, got {repeats}")
    memory = np.array([_memory(d, n) for d in devices])
    if n == 1:  # no link to time
        return Devices(bandwidth=np.full((1, 1), np.inf), memory=memory, speed=np.ones(1))
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    mesh = Mesh(np.array(devices), (AXIS,))
    run = _pair_program(mesh, pairs)
    elems = sorted({max(1, int(s) // 4) for s in sizes})
    times = np.zeros((len(pairs), len(elems)))
    for col, count in enumerate(elems):
        x = jax.device_put(
            np.ones((n, count), np.float32), NamedSharding(mesh, P(AXIS))
        )  # each device's buffer: (1, count) float32, the bytes one transfer moves
        for k in range(len(pairs)):
            times[k, col] = _median_time(run, np.array([k], np.int32), x, repeats)
    bandwidth = np.full((n, n), np.inf)
    for k, (i, j) in enumerate(pairs):
        bandwidth[i, j] = fit_bandwidth([4 * c for c in elems], times[k])
    return Devices(bandwidth=bandwidth, memory=memory, speed=np.ones(n))
