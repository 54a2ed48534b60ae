"""Text and JSON forms of a schedule. Both round-trip exactly.

Text form, one header line and one line per worker::

    schedule kind=1f1b stages=2 chunks=1 microbatches=2 replicas=1 layout=0,1 staggered=0 failed=-
    0:0 | F0.0 F0.1 BW0.0 BW0.1 OPT0
    0:1 | F1.0 BW1.0 F1.1 BW1.1 OPT1

Op tokens: ``F1.3`` is the forward of stage 1, microbatch 3 of the worker's own
replica; ``F1.3r0`` names another home replica (re-routed work); ``OPT1``
(``OPT1.3``: the asynchronous per-microbatch step after microbatch 3);
``SEND:act:1.3->0:2`` and ``RECV:grad:2.3<-0:2`` move a tensor between workers.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pjit_pipe.ir.ops import Kind, Op, Payload, Worker, format_op
from pjit_pipe.ir.schedule import Schedule, ScheduleError

_WORKER = r"(\d+):(\d+)"
_BODY = r"(\d+)\.(\d+)(?:r(\d+))?"
_COMPUTE_RE = re.compile(rf"^(F|BW|B|W){_BODY}$")
_OPT_RE = re.compile(r"^OPT(\d+)(?:\.(\d+))?$")
_COMM_RE = re.compile(rf"^(SEND|RECV):(act|grad):{_BODY}(->|<-){_WORKER}$")


def parse_op(token: str, worker: Worker) -> Op:
    """Parse one op token of `worker`'s program (see the module docstring)."""
    if m := _COMPUTE_RE.match(token):
        kind, s, mb, rep = m.groups()
        return Op(Kind(kind), int(s), int(mb), worker.replica if rep is None else int(rep))
    if m := _OPT_RE.match(token):
        mb = -1 if m.group(2) is None else int(m.group(2))
        return Op(Kind.OPT, int(m.group(1)), mb, worker.replica)
    if m := _COMM_RE.match(token):
        kind, payload, s, mb, rep, arrow, pr, ps = m.groups()
        if (kind == "SEND") != (arrow == "->"):
            raise ScheduleError(f"op {token!r}: SEND uses '->', RECV uses '<-'")
        replica = worker.replica if rep is None else int(rep)
        return Op(Kind(kind), int(s), int(mb), replica, Payload(payload), Worker(int(pr), int(ps)))
    raise ScheduleError(f"cannot parse op {token!r} of worker {worker}")


def _format_program(worker: Worker, ops: tuple[Op, ...]) -> list[str]:
    return [format_op(op, home_replica=worker.replica) for op in ops]


def _header_fields(s: Schedule) -> dict[str, str]:
    return {
        "kind": s.kind,
        "stages": str(s.stages),
        "chunks": str(s.chunks),
        "microbatches": str(s.microbatches),
        "replicas": str(s.replicas),
        "layout": ",".join(map(str, s.layout)),
        "staggered": str(int(s.staggered)),
        "failed": ",".join(str(w) for w in sorted(s.failed)) or "-",
    }


def to_text(schedule: Schedule) -> str:
    """The human-readable text form."""
    header = " ".join(f"{k}={v}" for k, v in _header_fields(schedule).items())
    lines = [f"schedule {header}"]
    for w in schedule.workers:
        if w in schedule.failed:
            lines.append(f"{w} | (failed)")
        else:
            lines.append(f"{w} | " + " ".join(_format_program(w, schedule.program(w))))
    return "\n".join(lines) + "\n"


def _parse_workers(text: str) -> frozenset[Worker]:
    if text == "-":
        return frozenset()
    return frozenset(Worker(*map(int, w.split(":"))) for w in text.split(","))


def _schedule_from_fields(
    fields: dict[str, str], programs: dict[Worker, tuple[Op, ...]]
) -> Schedule:
    try:
        return Schedule(
            stages=int(fields["stages"]),
            chunks=int(fields["chunks"]),
            microbatches=int(fields["microbatches"]),
            replicas=int(fields["replicas"]),
            layout=tuple(int(p) for p in fields["layout"].split(",")),
            programs=programs,
            failed=_parse_workers(fields["failed"]),
            staggered=bool(int(fields["staggered"])),
            kind=fields["kind"],
        )
    except (KeyError, ValueError) as e:
        raise ScheduleError(f"bad schedule header: {e}") from None


def from_text(text: str) -> Schedule:
    """Parse the text form written by `to_text`."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("schedule "):
        raise ScheduleError("text form must start with a 'schedule ...' header line")
    fields = dict(item.split("=", 1) for item in lines[0].split()[1:])
    programs: dict[Worker, tuple[Op, ...]] = {}
    for line in lines[1:]:
        name, _, body = line.partition("|")
        m = re.fullmatch(_WORKER, name.strip())
        if m is None:
            raise ScheduleError(f"bad worker line {line!r}")
        w = Worker(int(m.group(1)), int(m.group(2)))
        if body.strip() == "(failed)":
            continue
        programs[w] = tuple(parse_op(tok, w) for tok in body.split())
    return _schedule_from_fields(fields, programs)


def to_json(schedule: Schedule) -> dict[str, Any]:
    """A JSON-ready dict; ops use the text tokens."""
    fields = _header_fields(schedule)
    return {
        "version": 1,
        "kind": schedule.kind,
        "stages": schedule.stages,
        "chunks": schedule.chunks,
        "microbatches": schedule.microbatches,
        "replicas": schedule.replicas,
        "layout": list(schedule.layout),
        "staggered": schedule.staggered,
        "failed": [] if fields["failed"] == "-" else fields["failed"].split(","),
        "programs": [
            {"worker": str(w), "ops": _format_program(w, schedule.program(w))}
            for w in schedule.workers
            if w not in schedule.failed
        ],
    }


def from_json(data: dict[str, Any] | str) -> Schedule:
    """Inverse of `to_json` (accepts the dict or its JSON string)."""
    if isinstance(data, str):
        data = json.loads(data)
    fields = {
        "kind": data["kind"],
        "stages": str(data["stages"]),
        "chunks": str(data["chunks"]),
        "microbatches": str(data["microbatches"]),
        "replicas": str(data["replicas"]),
        "layout": ",".join(map(str, data["layout"])),
        "staggered": str(int(data["staggered"])),
        "failed": ",".join(data["failed"]) or "-",
    }
    programs = {}
    for entry in data["programs"]:
        w = Worker(*map(int, entry["worker"].split(":")))
        programs[w] = tuple(parse_op(tok, w) for tok in entry["ops"])
    return _schedule_from_fields(fields, programs)
