"""The cost model of a plan: its iteration period and each device's memory.

A plan cuts the L profiled layers into P contiguous stages (inclusive [first,
last] ranges), places stage p of replica r on device mapping[r][p] (D x P
distinct device ids) and names a schedule kind. With m microbatches per
replica:

- Compute. Stage p's F, B and W are the sums of its layers' times, divided by
  the speed of the device that runs it.
- Transfers. The activation from (r, p) to (r, p+1), and its gradient back,
  carry the bytes of the cut after stage p (every tensor whose edge crosses it,
  skip edges included) over that directed link: bytes / bandwidth. This is the
  simulator's C, one per link; a transfer delays its consumer and does not
  occupy either device (the event simulator's latency).
- Gradient all-reduce. Stage p's parameter gradients are all-reduced over its
  D replicas by a ring: 2 (D-1)/D * parameter bytes over the slowest link
  (either direction) between two devices of the group. It is the duration of
  the stage's OPT op, which waits for every replica's last W of that stage, so
  only its part that no other work hides lengthens the iteration.
- Period. The pjit_pipe event simulator's steady period of the schedule under
  those per-device op times and per-link C, over two iterations with the
  iteration barrier (ms).
- Memory of a device: STATE_COPIES x its stage's parameter bytes (weights,
  gradients and Adam's two moments) plus its stage's activation bytes per
  microbatch times the schedule's peak in-flight microbatches on that position
  (pjit_pipe.ir.memory: 1F1B keeps P-p, GPipe m). A plan that needs more than
  any of its devices holds is infeasible. Unused devices hold 0.

Only single-chunk schedule kinds (PLANNABLE_KINDS) are planned: a stage is one
device's contiguous slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from pjit_pipe.compiler import ScheduleSpec, build_schedule
from pjit_pipe.errors import PjitPipeError
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.planner.devices import Devices
from pjit_pipe.planner.profile import Profile
from pjit_pipe.simulator import SimResult, simulate

PLANNABLE_KINDS = ("1f1b", "zb-h1", "gpipe", "zb-h2")
STATE_COPIES = 4  # weights + gradients + Adam's first and second moments
MS_PER_S = 1000.0


class PlanError(PjitPipeError):
    """A plan that does not fit the profile or the devices; the message says which part."""


@dataclass(frozen=True)
class Plan:
    """stages: P inclusive (first, last) layer ranges; mapping: D rows of P device ids."""

    stages: tuple[tuple[int, int], ...]
    mapping: tuple[tuple[int, ...], ...]
    schedule: str

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def replicas(self) -> int:
        return len(self.mapping)

    @classmethod
    def from_cuts(cls, cuts: tuple[int, ...], layers: int, mapping, schedule: str) -> Plan:
        """Stages from the first layer of each stage after the first (sorted cut positions)."""
        starts = (0, *cuts)
        ends = (*(c - 1 for c in cuts), layers - 1)
        return cls(tuple(zip(starts, ends, strict=True)), tuple(map(tuple, mapping)), schedule)

    def to_json(self) -> dict:
        return {
            "stages": [list(s) for s in self.stages],
            "mapping": [list(r) for r in self.mapping],
            "schedule": self.schedule,
        }


@dataclass(frozen=True)
class Evaluation:
    """A priced plan: period in ms (None if infeasible) and bytes per device."""

    plan: Plan
    period: float | None
    memory: tuple[float, ...]
    result: SimResult | None = None

    @property
    def feasible(self) -> bool:
        return self.period is not None


@lru_cache(maxsize=256)
def schedule_of(kind: str, stages: int, microbatches: int, replicas: int) -> Schedule:
    """The fault-free schedule a plan runs (cached: plans share few shapes)."""
    return build_schedule(ScheduleSpec(kind, stages, microbatches, replicas=replicas))


@lru_cache(maxsize=256)
def peak_inflight(kind: str, stages: int, microbatches: int) -> tuple[float, ...]:
    """Peak in-flight microbatches of each pipeline position under `kind`."""
    peaks = peak_memory(schedule_of(kind, stages, microbatches, 1))
    return tuple(peaks[Worker(0, p)] for p in range(stages))


class CostModel:
    """Prices plans of one profile on one set of devices at m microbatches per replica."""

    def __init__(self, profile: Profile, devices: Devices, microbatches: int):
        self.profile, self.devices, self.microbatches = profile, devices, microbatches
        zero = np.zeros(1)
        self._f, self._b, self._w, self._act, self._param = (
            np.concatenate([zero, np.cumsum(x)])
            for x in (profile.f, profile.b, profile.w, profile.act_bytes, profile.param_bytes)
        )
        self.cut = profile.cut_bytes()  # cut[k]: bytes between layers k and k+1
        # ms per byte over each directed link (diagonal: 0, a device keeps its tensors)
        self.ms_per_byte = MS_PER_S / devices.bandwidth

    def segment(self, first: int, last: int) -> tuple[float, float, float, float, float]:
        """(F, B, W, activation bytes, parameter bytes) of layers first..last."""
        a, b = first, last + 1
        return tuple(
            float(x[b] - x[a]) for x in (self._f, self._b, self._w, self._act, self._param)
        )

    def allreduce(self, mapping, param_bytes) -> np.ndarray:
        """Ring all-reduce time (ms) of each stage's `param_bytes` over its replicas.

        mapping: D x P device ids; param_bytes: (P,). Priced at the group's slowest link.
        """
        cols = np.asarray(mapping)
        d = cols.shape[0]
        if d < 2:
            return np.zeros(cols.shape[1])
        slowest = self.ms_per_byte[cols[:, None, :], cols[None, :, :]].max(axis=(0, 1))
        return 2 * (d - 1) / d * np.asarray(param_bytes) * slowest

    def stage_memory(self, kind: str, stages: list[tuple[int, int]]) -> list[float]:
        """Bytes each pipeline position needs under `kind` (see the module docstring)."""
        peaks = peak_inflight(kind, len(stages), self.microbatches)
        out = []
        for (first, last), peak in zip(stages, peaks, strict=True):
            _, _, _, act, param = self.segment(first, last)
            out.append(STATE_COPIES * param + peak * act)
        return out

    def check(self, plan: Plan) -> None:
        """Raise PlanError unless `plan` covers the layers and uses distinct, existing devices."""
        n_layers, n_dev = len(self.profile), len(self.devices)
        if plan.schedule not in PLANNABLE_KINDS:
            raise PlanError(
                f"schedule {plan.schedule!r} cannot be planned; choose one of "
                f"{', '.join(PLANNABLE_KINDS)} (one contiguous stage per device)"
            )
        expect = 0
        for first, last in plan.stages:
            if first != expect or last < first:
                raise PlanError(
                    f"stages {[list(s) for s in plan.stages]} must be contiguous inclusive "
                    f"[first, last] ranges starting at 0 and covering layers 0..{n_layers - 1}"
                )
            expect = last + 1
        if expect != n_layers:
            raise PlanError(
                f"stages end at layer {expect - 1} but the profile has layers 0..{n_layers - 1}"
            )
        if not plan.mapping or any(len(row) != plan.num_stages for row in plan.mapping):
            raise PlanError(
                f"mapping must be D rows of {plan.num_stages} device ids (one per stage), "
                f"got {[list(r) for r in plan.mapping]}"
            )
        ids = [d for row in plan.mapping for d in row]
        if len(ids) > n_dev:
            raise PlanError(
                f"mapping uses D x P = {len(plan.mapping)} x {plan.num_stages} = {len(ids)} "
                f"devices but only {n_dev} are described"
            )
        if any(type(d) is not int or not 0 <= d < n_dev for d in ids) or len(set(ids)) < len(ids):
            raise PlanError(f"mapping must hold distinct device ids in 0..{n_dev - 1}, got {ids}")

    def memory(self, plan: Plan) -> tuple[float, ...]:
        """Bytes per device (0 on devices the plan leaves out)."""
        per_stage = self.stage_memory(plan.schedule, list(plan.stages))
        out = [0.0] * len(self.devices)
        for row in plan.mapping:
            for p, d in enumerate(row):
                out[d] = per_stage[p]
        return tuple(out)

    def fits(self, plan: Plan) -> bool:
        mem = self.memory(plan)
        return all(mem[d] <= self.devices.memory[d] for row in plan.mapping for d in row)

    def evaluate(self, plan: Plan, keep_result: bool = False, iterations: int = 2) -> Evaluation:
        """Price `plan` (checked first): None period when it does not fit in memory.

        The period is the steady period over `iterations`; with the iteration
        barrier every iteration repeats the first, so iterations=1 (its
        makespan, OPT included) gives the same number at half the price: the
        search uses that.
        """
        self.check(plan)
        mem = self.memory(plan)
        if not self.fits(plan):
            return Evaluation(plan, None, mem)
        result = self.simulate(plan, iterations)
        return Evaluation(plan, result.steady_period, mem, result if keep_result else None)

    def simulate(self, plan: Plan, iterations: int = 2) -> SimResult:
        """The event simulation of `plan` (times in ms)."""
        P, D, m = plan.num_stages, plan.replicas, self.microbatches
        seg = [self.segment(a, b) for a, b in plan.stages]
        speed = self.devices.speed
        mapping = plan.mapping
        reduce = self.allreduce(mapping, [s[4] for s in seg])
        # per worker (F, B, W, OPT) in ms
        table = {
            Worker(r, p): (
                seg[p][0] / speed[mapping[r][p]],
                seg[p][1] / speed[mapping[r][p]],
                seg[p][2] / speed[mapping[r][p]],
                reduce[p],
            )
            for r in range(D)
            for p in range(P)
        }
        cut_after = [self.cut[last] for _, last in plan.stages[:-1]]

        def duration(worker: Worker, op: Op) -> float:
            f, b, w, opt = table[worker]
            match op.kind:
                case Kind.F:
                    return f
                case Kind.B:
                    return b
                case Kind.W:
                    return w
                case Kind.BW:
                    return b + w
                case Kind.OPT:
                    return opt
            return 0.0

        def latency(src: Worker, dst: Worker) -> float:
            boundary = min(src.stage, dst.stage)
            a, b = mapping[src.replica][src.stage], mapping[dst.replica][dst.stage]
            return cut_after[boundary] * self.ms_per_byte[a, b]

        costs = Costs(f=[s[0] for s in seg], b=[s[1] for s in seg], w=[s[2] for s in seg])
        schedule = schedule_of(plan.schedule, P, m, D)
        return simulate(schedule, costs, iterations=iterations, duration=duration, latency=latency)
