"""The events of a model's forward pass: the places where a stage may begin.

`trace.py` records them (and replays the model between two of them); the
cutter, the stacks of nn.scan and `StageCut` read them. They live apart from
the tracing machinery because every one of those reads the record, while only
the tracer makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax


@dataclass(frozen=True)
class Event:
    """One top-level call or boundary marker, as seen when the model was recorded.

    act: shapes of the activation (every array in the call's arguments, in
        flattening order), or None when it has none (such an event cannot
        start a stage).
    out: shapes of what the event returned (a call is skipped by returning
        stand-ins of these shapes).
    """

    kind: str  # "call", "boundary" or "iteration" (a cut inside an nn.scan)
    name: str  # the module's path, dotted ("transformer.h.0"), and ".method" if not __call__
    act: tuple[jax.ShapeDtypeStruct, ...] | None
    out: Any
    transform: str | None = None  # the linen transform around the child ("Scan", "Checkpoint")
    # An nn.scan call that can be cut between iterations: its length L. An
    # "iteration" event: the iteration k at which it begins a stage.
    iterations: int | None = None
    iteration: int = 0
    path: tuple[str, ...] | None = None  # the called module's path (its parameters' path)


def with_iterations(events: tuple[Event, ...]) -> tuple[Event, ...]:
    """The recorded events with the L-1 iteration events after each cuttable nn.scan."""
    out: list[Event] = []
    for e in events:
        out.append(e)
        out += [
            Event("iteration", f"{e.name}[{k}]", e.act, None, "Scan", iteration=k, path=e.path)
            for k in range(1, e.iterations or 1)
        ]
    return tuple(out)
