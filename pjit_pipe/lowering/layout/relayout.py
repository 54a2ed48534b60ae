"""Moving a training state from one program's device layout to another's
(`DeviceLayout.relayout`: to a failure variant, or back to the full mesh).

It has its own module because it is the one conversion that reads two layouts
at once and moves rows between devices, where device_state.py converts between
one layout and the per-stage trees. Device by device it keeps the rows a device
already holds for its position, copies the others from a live peer, and never
reads a device named unavailable.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import jax

from pjit_pipe.errors import StateError
from pjit_pipe.lowering.layout.flat_buffers import Buffers

if TYPE_CHECKING:
    from pjit_pipe.lowering.layout.device_state import DeviceLayout


def relayout_state(
    target: DeviceLayout,
    source: DeviceLayout,
    params: Buffers,
    opt: Buffers,
    unavailable: Collection[Any] = (),
) -> tuple[Buffers, Buffers, int]:
    """A state in `source`'s layout -> `target`'s layout, and the bytes copied.

    A device that runs the same position in both layouts keeps its own row
    (no copy); a device new to its position (a rejoining one) copies the row
    from the first live source device of that position. Rows of devices in
    `unavailable` (failed ones) are never read.
    """
    if [len(h) for h in source.held] != [len(h) for h in target.held]:
        raise StateError("relayout: the two programs hold different numbers of chunks")
    for p in range(len(target.held)):
        if not target.compatible(source, p):
            raise StateError(
                f"relayout: position {p} holds different stages or row formats in the "
                "two programs; go through the module layout (state.params) instead"
            )
    where = dict(zip(source.devices, source.positions, strict=True))
    lane = dict(zip(source.devices, source.tensor_index, strict=True))
    moved = 0
    out = []
    for part, bufs in (("params", params), ("opt", opt)):
        rows: dict[str, dict[Any, jax.Array]] = {}
        for k, b in bufs.items():
            shards = {s.device: s for s in b.addressable_shards}
            rows[k] = {}
            for d, p, t in zip(target.devices, target.positions, target.tensor_index, strict=True):
                if d.process_index != jax.process_index():
                    continue
                if where.get(d) == p and lane.get(d) == t and d not in unavailable:
                    rows[k][d] = shards[d].data
                    continue
                peers = [e for e in source.holders(p, unavailable) if e in shards and lane[e] == t]
                if not peers:
                    raise StateError(
                        f"relayout: no live device of position {p} holds its rows here"
                    )
                rows[k][d] = jax.device_put(shards[peers[0]].data, d)
                moved += rows[k][d].nbytes
        out.append(target.assemble(part, rows))
    return out[0], out[1], moved
