"""The devices a plan runs on: link bandwidths, memory and relative speed.

JSON form (docs/design.md section 4)::

    {"bandwidth": N x N bytes/s, "memory": bytes | [bytes] * N, "speed"?: [relative] * N}

bandwidth[i][j] is what a tensor from device i to device j gets (the diagonal
is ignored: a device does not send to itself). speed scales compute: a device
of speed 2 runs a layer in half its profiled time (default 1 everywhere).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pjit_pipe.errors import PjitPipeError


class DevicesError(PjitPipeError):
    """A malformed devices description; the message names the key and the fix."""


@dataclass(frozen=True)
class Devices:
    """N devices: bandwidth (N x N bytes/s), memory (N bytes), speed (N, relative)."""

    bandwidth: np.ndarray
    memory: np.ndarray
    speed: np.ndarray

    def __len__(self) -> int:
        return len(self.memory)

    def to_json(self) -> dict:
        """The JSON form; the diagonal (ignored on reading) is written as 0, not infinity."""
        return {
            "bandwidth": np.where(np.eye(len(self), dtype=bool), 0.0, self.bandwidth).tolist(),
            "memory": self.memory.tolist(),
            "speed": self.speed.tolist(),
        }


def _numbers(value: object, what: str, n: int | None, positive: bool) -> np.ndarray:
    items = value if isinstance(value, list) else None
    if items is None or (n is not None and len(items) != n):
        size = f"{n} " if n is not None else ""
        raise DevicesError(f"{what}: expected a list of {size}numbers, got {value!r}"[:200])
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise DevicesError(f"{what}: {x!r} is not a finite number")
        if x < 0 or (positive and x == 0):
            raise DevicesError(f"{what}: must be {'> 0' if positive else '>= 0'}, got {x}")
    return np.array(items, dtype=float)


def devices_from_json(data: object, source: str = "--devices") -> Devices:
    """Validate the JSON form (see the module docstring)."""
    if not isinstance(data, dict) or "bandwidth" not in data or "memory" not in data:
        raise DevicesError(f'{source}: expected {{"bandwidth": N x N, "memory": ..., "speed"?}}')
    unknown = set(data) - {"bandwidth", "memory", "speed"}
    if unknown:
        raise DevicesError(
            f"{source}: unknown keys {sorted(unknown)}; allowed: bandwidth, memory, speed"
        )
    rows = data["bandwidth"]
    if not isinstance(rows, list) or not rows:
        raise DevicesError(f"{source}: bandwidth must be an N x N list of lists (bytes/s)")
    n = len(rows)
    bandwidth = np.zeros((n, n))
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != n:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise DevicesError(
                f"{source}: bandwidth must be N x N: it has {n} rows but row {i} has {got} entries"
            )
        vals = _numbers(row, f"{source}: bandwidth[{i}]", n, positive=False)
        off = np.delete(vals, i)
        if (off <= 0).any():
            raise DevicesError(f"{source}: bandwidth[{i}] has a link <= 0 bytes/s: {row}")
        bandwidth[i] = vals
    memory = data["memory"]
    if isinstance(memory, list):
        mem = _numbers(memory, f"{source}: memory", n, positive=True)
    else:
        mem = _numbers([memory], f"{source}: memory", 1, positive=True).repeat(n)
    speed = _numbers(data.get("speed", [1.0] * n), f"{source}: speed", n, positive=True)
    np.fill_diagonal(bandwidth, np.inf)
    return Devices(bandwidth=bandwidth, memory=mem, speed=speed)


def load_devices(path: str | Path) -> Devices:
    """Read a devices JSON file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise DevicesError(f"--devices: cannot read {str(path)!r}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DevicesError(f"--devices: {path}:{e.lineno}: malformed JSON: {e.msg}") from None
    return devices_from_json(data, f"--devices {path}")


def cluster(
    nodes: int,
    per_node: int,
    intra: float = 150e9,
    inter: float = 100e9 / 8,
    memory: float = 32e9,
) -> Devices:
    """`nodes` nodes of `per_node` devices: `intra` bytes/s inside a node, `inter` between.

    Defaults: NVLink-class 150 GB/s links, 100 Gb/s between nodes, 32 GB per device.
    """
    n = nodes * per_node
    node = np.arange(n) // per_node
    bandwidth = np.where(node[:, None] == node[None, :], intra, inter).astype(float)
    np.fill_diagonal(bandwidth, np.inf)
    return Devices(bandwidth=bandwidth, memory=np.full(n, float(memory)), speed=np.ones(n))
