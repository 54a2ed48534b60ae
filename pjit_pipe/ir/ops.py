"""Ops of the schedule IR: what one worker does at one step of its program.

A worker is one device, named by its (replica, stage) position in the
fault-free placement. An op names its kind, the (virtual) stage it works on,
the microbatch and that microbatch's home replica; the worker that runs it is
the program it sits in. Re-routing a microbatch to a peer therefore changes
which program holds the op, never the op itself.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple


class Kind(StrEnum):
    """Op kinds. BW is B and W fused; SEND/RECV move one tensor between workers."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    OPT = "OPT"
    SEND = "SEND"
    RECV = "RECV"


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
COMM_KINDS = frozenset({Kind.SEND, Kind.RECV})


class Payload(StrEnum):
    """What a SEND/RECV carries: a stage's output activation or its input gradient."""

    ACT = "act"
    GRAD = "grad"


class Worker(NamedTuple):
    """A device, named by its fault-free position in the D x P mesh."""

    replica: int
    stage: int

    def __str__(self) -> str:
        return f"{self.replica}:{self.stage}"


class Op(NamedTuple):
    """One step of a worker's program.

    `stage` is the virtual stage (chunk) index in [0, stages*chunks). For OPT,
    `replica` is the running worker's replica and `mb` is -1 (one step per
    iteration, after all its microbatches) or, in an asynchronous schedule, the
    microbatch whose backward it applies (one step per microbatch). For SEND/RECV,
    `payload` says which tensor moves: ACT is the output of F(stage), GRAD the
    input gradient produced by B/BW(stage); `peer` is the other worker.
    """

    kind: Kind
    stage: int
    mb: int = -1
    replica: int = 0
    payload: Payload | None = None
    peer: Worker | None = None

    def __str__(self) -> str:
        return format_op(self, home_replica=None)


def F(stage: int, mb: int, replica: int = 0) -> Op:
    return Op(Kind.F, stage, mb, replica)


def B(stage: int, mb: int, replica: int = 0) -> Op:
    return Op(Kind.B, stage, mb, replica)


def W(stage: int, mb: int, replica: int = 0) -> Op:
    return Op(Kind.W, stage, mb, replica)


def BW(stage: int, mb: int, replica: int = 0) -> Op:
    return Op(Kind.BW, stage, mb, replica)


def OPT(stage: int, replica: int = 0, mb: int = -1) -> Op:
    return Op(Kind.OPT, stage, mb, replica)


def SEND(payload: Payload, stage: int, mb: int, replica: int, to: Worker) -> Op:
    return Op(Kind.SEND, stage, mb, replica, payload, to)


def RECV(payload: Payload, stage: int, mb: int, replica: int, src: Worker) -> Op:
    return Op(Kind.RECV, stage, mb, replica, payload, src)


def format_op(op: Op, home_replica: int | None) -> str:
    """Text token of an op, e.g. ``F1.3``, ``B0.2r1``, ``OPT2``, ``OPT2.3``, ``SEND:act:1.3->0:2``.

    The ``rN`` suffix is left out when the op's replica equals `home_replica`
    (the running worker's own replica).
    """
    if op.kind is Kind.OPT:
        return f"OPT{op.stage}" if op.mb < 0 else f"OPT{op.stage}.{op.mb}"
    rep = "" if op.replica == home_replica else f"r{op.replica}"
    body = f"{op.stage}.{op.mb}{rep}"
    if op.kind is Kind.SEND:
        return f"SEND:{op.payload.value}:{body}->{op.peer}"
    if op.kind is Kind.RECV:
        return f"RECV:{op.payload.value}:{body}<-{op.peer}"
    return f"{op.kind.value}{body}"
