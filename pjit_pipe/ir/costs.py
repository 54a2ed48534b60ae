"""The cost model: how long each op takes and how long a tensor takes to travel."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pjit_pipe.ir.ops import Kind, Op, Worker
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.slow import check_factor


def _per_position(name: str, value: float | Sequence[float], stages: int) -> tuple[float, ...]:
    vals = (float(value),) * stages if isinstance(value, int | float) else tuple(map(float, value))
    if len(vals) != stages:
        raise ScheduleError(f"{name}: {len(vals)} per-stage costs given for {stages} stages")
    if any(v < 0 for v in vals):
        raise ScheduleError(f"{name}: costs must be >= 0, got {list(vals)}")
    return vals


def _split_stages(schedule: Schedule) -> set[int]:
    """The virtual stages `schedule` runs as separate B and W."""
    return {op.stage for _, _, op in schedule.ops() if op.kind in (Kind.B, Kind.W)}


@dataclass(frozen=True)
class Costs:
    """Per-stage op times (docs/design.md section 3): what the schedulers and simulator price.

    Scalars apply to every stage; sequences give one value per pipeline
    position. All times are in the same (arbitrary) unit.

    Attributes:
        f: F of one microbatch on one pipeline position (all the chunks it holds).
        b: B (the input gradient) of one microbatch on one position.
        w: W (the weight gradient) of one microbatch on one position.
        c: Time of one activation transfer.
        opt: Time of OPT, per chunk.
        tick: The fixed time of one tick of the compiled loop, whatever it runs:
            the loop step, its conditionals (on a GPU each executed `lax.cond`
            copies its predicate to the host and waits) and the launch of its
            ppermutes. Only the lockstep price of a tick table counts it (once
            per tick, `simulator.simulate.packed_events`), so with tick > 0 the
            packer prefers fewer, fuller ticks; event-driven schedules have no
            ticks and ignore it. 0 (the default) keeps every price as it was.
            The CLI takes it as `--tick-cost T`; the frontend measures it with
            `costs="measure"` (frontend/planning/measure.py).
        f_fused: Per stage, the F of a stage that the schedule does not split
            (it runs no B or W of that stage); None (the default) means `f`.
            It differs on real models: the lowering compiles a split stage's F
            to also store what its W reads (a dense layer's input), which a
            fused backward recomputes from the stored matmul outputs.
        bw: Per stage, the fused backward of a stage the schedule does not
            split; None (the default) means b + w. A fused backward is one
            program where B and W are two. Measured costs give `f_fused` and
            `bw`, so 1F1B is priced at what it runs, not at the split's costs.
        fbw: Per position, one microbatch's forward and whole backward of the
            loss stage (the last virtual stage) run as one program; None means
            the split ops' sum, so nothing changes. The lowering runs them so
            wherever a tick of the table holds them all
            (`ir.ticks.fused_loss_ops`): one program keeps its intermediates
            out of memory and XLA fuses across the forward and backward, which
            two programs cannot (1.33-1.54x on a GPU, docs/tick_packing.md).
            Only the lockstep price of a tick table counts it (`loss_fusion`);
            the event-driven simulator runs the IR's ops one by one.
        slow: Slow workers (ir/slow.py): ((replica, stage), factor) pairs,
            sorted; each op of such a worker takes factor (>= 1) times its
            price, OPT included (a transfer's C does not change). A mapping
            {(replica, stage): factor} is accepted and stored so. Empty (the
            default): every worker runs at full speed.
    """

    f: float | Sequence[float] = 1.0
    b: float | Sequence[float] = 1.0
    w: float | Sequence[float] = 1.0
    c: float = 0.0
    opt: float = 0.0
    tick: float = 0.0
    f_fused: float | Sequence[float] | None = None
    bw: float | Sequence[float] | None = None
    fbw: float | Sequence[float] | None = None
    slow: tuple[tuple[Worker, float], ...] | Mapping[tuple[int, int], float] = ()

    def __post_init__(self) -> None:
        pairs = self.slow.items() if isinstance(self.slow, Mapping) else self.slow
        speeds = {}
        for key, factor in pairs:
            worker = Worker(*key)
            speeds[worker] = check_factor(factor, f"worker {worker}")
        object.__setattr__(self, "slow", tuple(sorted(speeds.items())))

    def factors(self) -> dict[Worker, float]:
        """Each slow worker's factor (workers not in it run at factor 1).

        Returns:
            {Worker: factor} of `slow`.
        """
        return dict(self.slow)

    def with_slow(self, slow: Mapping[tuple[int, int], float]) -> Costs:
        """These costs with `slow` as the slow workers' factors (factors of 1 dropped).

        Args:
            slow: {(replica, stage): factor >= 1}.

        Returns:
            A copy whose `slow` holds the factors above 1.

        Raises:
            ScheduleError: A factor below 1 or not finite.
        """
        return dataclasses.replace(self, slow={w: f for w, f in slow.items() if f != 1.0})

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse the CLI form ``F,B,W[,C]``.

        Args:
            text: Three or four comma-separated numbers >= 0.

        Returns:
            Costs with those f, b, w (and c); the other fields at their defaults.

        Raises:
            ScheduleError: `text` is not 3 or 4 numbers, or one is negative.
        """
        try:
            parts = [float(x) for x in text.split(",")]
        except ValueError:
            raise ScheduleError(f"--costs: expected numbers F,B,W[,C], got {text!r}") from None
        if len(parts) not in (3, 4):
            raise ScheduleError(f"--costs: expected 3 or 4 numbers F,B,W[,C], got {text!r}")
        if any(p < 0 for p in parts):
            raise ScheduleError(f"--costs: costs must be >= 0, got {text!r}")
        return cls(*parts)

    def per_stage(self, stages: int) -> list[tuple[float, float, float]]:
        """(F, B, W) of each pipeline position, after checking every field.

        Args:
            stages: P, the pipeline positions.

        Returns:
            One (F, B, W) triple per position.

        Raises:
            ScheduleError: A per-stage sequence (f, b, w, f_fused, bw, fbw) has
                other than `stages` values, or a cost is negative (tick: not a
                number >= 0).
        """
        fs, bs, ws = (
            _per_position(n, v, stages) for n, v in (("F", self.f), ("B", self.b), ("W", self.w))
        )
        for name, value in (("f_fused", self.f_fused), ("bw", self.bw), ("fbw", self.fbw)):
            if value is not None:
                _per_position(name, value, stages)
        if self.c < 0 or self.opt < 0:
            raise ScheduleError("communication and optimizer costs must be >= 0")
        if not self.tick >= 0:  # also rejects nan
            raise ScheduleError(
                f"tick: the fixed cost of a tick must be a number >= 0, got {self.tick!r}"
            )
        return list(zip(fs, bs, ws, strict=True))

    def fused_per_stage(self, stages: int) -> list[tuple[float, float]]:
        """(F, BW) of each pipeline position when the schedule does not split it.

        Args:
            stages: P, the pipeline positions.

        Returns:
            One (F, BW) pair per position: `f_fused` and `bw`, or f and b + w
            where those are None.

        Raises:
            ScheduleError: As `per_stage`.
        """
        table = self.per_stage(stages)
        fs = (
            [f for f, _, _ in table]
            if self.f_fused is None
            else _per_position("f_fused", self.f_fused, stages)
        )
        bws = (
            [b + w for _, b, w in table]
            if self.bw is None
            else _per_position("bw", self.bw, stages)
        )
        return list(zip(fs, bws, strict=True))

    def duration_fn(self, schedule: Schedule):
        """A (worker, op) -> time function for `schedule`'s shape.

        A stage the schedule runs as B and W takes (f, b, w), any other
        (f_fused, bw); each is divided by the chunks, since a position's costs
        cover all the chunks it holds. OPT takes `opt`, other ops 0. A slow
        worker's ops take its factor times as long.

        Args:
            schedule: The schedule whose ops are timed.

        Returns:
            duration(worker, op) -> time.

        Raises:
            ScheduleError: As `per_stage`, for `schedule.stages`.
        """
        table = self.per_stage(schedule.stages)
        fused = self.fused_per_stage(schedule.stages)
        split = _split_stages(schedule)
        v = schedule.chunks
        speeds = self.factors()
        if speeds:
            healthy = dataclasses.replace(self, slow=()).duration_fn(schedule)
            return lambda worker, op: healthy(worker, op) * speeds.get(worker, 1.0)

        def duration(worker: Worker, op: Op) -> float:
            f, b, w = table[schedule.layout[op.stage]]
            if op.stage not in split:
                f, bw = fused[schedule.layout[op.stage]]
            else:
                bw = b + w
            match op.kind:
                case Kind.F:
                    return f / v
                case Kind.B:
                    return b / v
                case Kind.W:
                    return w / v
                case Kind.BW:
                    return bw / v
                case Kind.OPT:
                    return self.opt
            return 0.0

        return duration

    def loss_fusion(self, schedule: Schedule) -> float:
        """The loss stage's fused price over its split price, for one microbatch.

        The fused price is `fbw`; the split price is F + BW, or F + B + W where
        the schedule splits that stage. The lockstep price scales the ops of a
        fused group by it.

        Args:
            schedule: The schedule whose last virtual stage is the loss stage.

        Returns:
            The ratio; 1.0 without `fbw` (or when the split price is 0).

        Raises:
            ScheduleError: As `per_stage`, for `schedule.stages`.
        """
        if self.fbw is None:
            return 1.0
        last = schedule.num_virtual_stages - 1
        duration = dataclasses.replace(self, slow=()).duration_fn(schedule)
        worker = Worker(0, schedule.layout[last])
        kinds = (Kind.F, Kind.B, Kind.W) if last in _split_stages(schedule) else (Kind.F, Kind.BW)
        apart = sum(duration(worker, Op(k, last, 0)) for k in kinds)
        fused = _per_position("fbw", self.fbw, schedule.stages)[worker.stage] / schedule.chunks
        return fused / apart if apart > 0 else 1.0

    def ideal(self, schedule: Schedule) -> float:
        """One stage's work per iteration (the busiest stage's, if uneven).

        The bubble-free lower bound on an iteration's time.

        Args:
            schedule: Gives the stages, microbatches and chunks.

        Returns:
            max over positions of m (F + B + W), plus chunks x opt.

        Raises:
            ScheduleError: As `per_stage`, for `schedule.stages`.
        """
        m = schedule.microbatches
        return max(m * (f + b + w) for f, b, w in self.per_stage(schedule.stages)) + (
            schedule.chunks * self.opt
        )
