"""The validator: accepts a schedule or raises ScheduleError naming the offending op."""

from __future__ import annotations

from collections import Counter

from pjit_pipe.ir.engine import Engine, Received, Tensor
from pjit_pipe.ir.memory import memory_trace
from pjit_pipe.ir.ops import COMM_KINDS, Kind, Op, Payload, Worker, format_op
from pjit_pipe.ir.schedule import Schedule, ScheduleError


def _at(w: Worker, i: int, op: Op) -> str:
    return f"op #{i} {format_op(op, w.replica)} on worker {w}"


def _params_stage(op: Op) -> int:
    """The virtual stage whose worker must run `op` (a RECV runs at the consumer's stage)."""
    if op.kind is Kind.RECV:
        return op.stage + (1 if op.payload is Payload.ACT else -1)
    return op.stage


def _check_shape(s: Schedule) -> None:
    if min(s.stages, s.chunks, s.microbatches, s.replicas) < 1:
        raise ScheduleError("stages, chunks, microbatches and replicas must all be >= 1")
    if (
        len(s.layout) != s.num_virtual_stages
        or sorted(Counter(s.layout).values()) != [s.chunks] * s.stages
    ):
        raise ScheduleError(
            f"layout {list(s.layout)} must place exactly {s.chunks} of the "
            f"{s.num_virtual_stages} virtual stages on each of the {s.stages} positions"
        )
    valid = set(s.workers)
    for w in list(s.programs) + list(s.failed):
        if w not in valid:
            raise ScheduleError(f"worker {w} is outside the {s.replicas}x{s.stages} mesh")
    for w in s.failed:
        if s.program(w):
            raise ScheduleError(f"failed worker {w} has a non-empty program")


def _check_ops(s: Schedule) -> None:
    """Every op in range and on a worker that holds its stage's parameters."""
    S, m, D = s.num_virtual_stages, s.microbatches, s.replicas
    for w, i, op in s.ops():
        if not 0 <= op.stage < S:
            raise ScheduleError(f"{_at(w, i, op)}: stage out of range [0, {S})")
        held = _params_stage(op)
        if not 0 <= held < S or s.layout[held] != w.stage:
            where = s.layout[held] if 0 <= held < S else "no position"
            raise ScheduleError(
                f"{_at(w, i, op)}: stage {held} lives on {where}, not position {w.stage}"
            )
        if op.kind is Kind.OPT:
            if op.replica != w.replica:
                raise ScheduleError(f"{_at(w, i, op)}: OPT must name its own worker's replica")
            if not -1 <= op.mb < m:
                raise ScheduleError(f"{_at(w, i, op)}: OPT microbatch must be -1 or in [0, {m})")
            continue
        if not 0 <= op.mb < m:
            raise ScheduleError(f"{_at(w, i, op)}: microbatch out of range [0, {m})")
        if not 0 <= op.replica < D:
            raise ScheduleError(f"{_at(w, i, op)}: replica out of range [0, {D})")
        if op.kind in COMM_KINDS and (op.peer not in set(s.alive_workers) or op.peer == w):
            raise ScheduleError(f"{_at(w, i, op)}: peer must be another live worker")


def _check_coverage(s: Schedule) -> None:
    """Each microbatch's F and backward run exactly once, F/B/W together; one OPT per held
    stage, or in an asynchronous schedule one per held stage and microbatch."""
    counts: Counter = Counter()
    home: dict[tuple, Worker] = {}
    for w, i, op in s.ops():
        if op.kind in COMM_KINDS:
            continue
        counts[op] += 1
        if counts[op] > 1:
            raise ScheduleError(f"{_at(w, i, op)}: runs twice")
        if op.kind is not Kind.OPT:
            slot = (op.stage, op.mb, op.replica)
            first = home.setdefault(slot, w)
            if first != w:
                raise ScheduleError(
                    f"{_at(w, i, op)}: F, B and W of one microbatch and stage must run on "
                    f"one worker, but it also runs on {first}"
                )
    for st in range(s.num_virtual_stages):
        for r in range(s.replicas):
            for j in range(s.microbatches):
                f, b, wg, bw = (Op(k, st, j, r) for k in (Kind.F, Kind.B, Kind.W, Kind.BW))
                if not counts[f]:
                    raise ScheduleError(f"{f} never runs")
                if counts[bw] and (counts[b] or counts[wg]):
                    raise ScheduleError(f"{bw} runs, and so does its split B or W")
                if not counts[bw] and not (counts[b] and counts[wg]):
                    missing = b if not counts[b] else wg
                    raise ScheduleError(f"{missing} never runs")
    steps = range(s.microbatches) if s.asynchronous else [-1]
    for w in s.alive_workers:
        for st in s.held_stages(w.stage):
            if s.asynchronous and counts[Op(Kind.OPT, st, -1, w.replica)]:
                raise ScheduleError(
                    f"OPT{st} on worker {w}: an asynchronous schedule steps per microbatch"
                )
            for j in steps:
                opt = Op(Kind.OPT, st, j, w.replica)
                if not counts[opt]:
                    raise ScheduleError(f"{format_op(opt, w.replica)} never runs on worker {w}")


def _check_local_order(s: Schedule, flow: Engine) -> None:
    """A dependency produced on the same worker must come earlier in its program."""
    for w in s.alive_workers:
        prog = s.program(w)
        produced_at: dict[tuple, int] = {}
        last_w: dict[int, int] = {}
        for i, op in enumerate(prog):
            for k in flow.produces(w, op):
                produced_at.setdefault(k, i)
            if op.kind in (Kind.W, Kind.BW):
                last_w[op.stage] = last_w[(op.stage, op.mb)] = i
        for i, op in enumerate(prog):
            opt_key = op.stage if op.mb < 0 else (op.stage, op.mb)
            needed = [last_w.get(opt_key, -1)] if op.kind is Kind.OPT else []
            needed += [
                produced_at.get(key, -1)
                for key, cross in flow.deps(w, op)
                if not cross and isinstance(key, Tensor | Received)
            ]
            at = max(needed, default=-1)
            if at > i:
                raise ScheduleError(
                    f"{_at(w, i, op)}: runs before {prog[at]} (#{at}) that it depends on"
                )


def _check_comm(s: Schedule, flow: Engine) -> None:
    """With explicit communication, every cross-worker tensor has one SEND and one RECV."""
    sends: Counter = Counter()
    recvs: Counter = Counter()
    for w, _, op in s.ops():
        if op.kind is Kind.SEND:
            sends[(op.payload, op.stage, op.mb, op.replica, w, op.peer)] += 1
        elif op.kind is Kind.RECV:
            recvs[(op.payload, op.stage, op.mb, op.replica, op.peer, w)] += 1
    for key in sends | recvs:
        if sends[key] != 1 or recvs[key] != 1:
            payload, st, j, r, src, dst = key
            raise ScheduleError(
                f"{payload.value} of stage {st} microbatch {j}r{r} from {src} to {dst}: "
                f"{sends[key]} SEND and {recvs[key]} RECV (need one each)"
            )
    received = {k for w, _, op in s.ops() if op.kind is Kind.RECV for k in flow.produces(w, op)}
    for w, i, op in s.ops():
        for key, _ in flow.deps(w, op):
            if isinstance(key, Received) and key not in received:
                raise ScheduleError(f"{_at(w, i, op)}: its input from another worker has no RECV")


def validate(schedule: Schedule, mem_limit: float | None = None) -> Schedule:
    """Raise ScheduleError unless `schedule` is valid (and within `mem_limit`); return it."""
    _check_shape(schedule)
    _check_ops(schedule)
    _check_coverage(schedule)
    flow = Engine(schedule)
    _check_local_order(schedule, flow)
    if flow.explicit_comm:
        _check_comm(schedule, flow)
    flow.run(lambda w, op: 1.0, lambda a, b: 0.0)  # raises DeadlockError
    if mem_limit is not None:
        for w in schedule.alive_workers:
            for i, used in enumerate(memory_trace(schedule, w)):
                if used > mem_limit + 1e-9:
                    op = schedule.program(w)[i]
                    raise ScheduleError(
                        f"{_at(w, i, op)}: memory {used:g} exceeds the limit {mem_limit:g}"
                    )
    return schedule
