"""The launcher's record of a `pjit-pipe train --processes N` run: `--events FILE`.

Every training process reports each committed step, failure and switch; the
launcher writes each once (whichever process reports it first), each
process's start, and each rejoin, as JSON lines with `t` in unix seconds
(DESIGN.md's contract: `process`, `step`, `failure`, `switch`, `rejoin`).
"""

from __future__ import annotations

import json
from typing import TextIO


class Events:
    """The launcher's record of the run: each step, failure and switch once,
    whichever process reports it first; `process` events from each process."""

    def __init__(self, path: str | None):
        self.file: TextIO | None = open(path, "a") if path else None  # noqa: SIM115
        self.seen: set[tuple] = set()

    def add(self, event: dict) -> bool:
        """Record `event` unless another process reported it already; True if new."""
        kind = event["event"]
        if kind == "step":
            key: tuple = (kind, event["step"])
        elif kind in ("failure", "switch"):
            key = (kind, event["step"], json.dumps(event["failed"]))
        elif kind == "rejoin":
            key = (kind, event["step"])
        else:
            key = (kind, event.get("process"), event.get("pid"))
        if key in self.seen:
            return False
        self.seen.add(key)
        if self.file is not None:
            fields = {k: event[k] for k in _EVENT_FIELDS[kind] if k in event}
            self.file.write(json.dumps({"event": kind, "t": event["t"], **fields}) + "\n")
            self.file.flush()
        return True

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


_EVENT_FIELDS = {
    "process": ("process", "pid", "workers"),
    "step": ("step", "loss"),
    "failure": ("step", "failed"),
    "switch": ("step", "failed"),
    "rejoin": ("step", "workers"),
}
