"""`PipelineOptions`: every option of `pipeline()`, typed, documented and checked once.

The options are checked when they are made, so a bad value fails at
`pipeline(...)` with an `OptionError` naming the option, the values it takes
and the fix, before any model is traced or compiled. `Pipelined.with_options`
is `dataclasses.replace` on them, so a changed copy is checked the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from pjit_pipe.errors import FailurePlanError, MeshError, OptionError
from pjit_pipe.frontend.cutter.cut import BALANCE
from pjit_pipe.frontend.mesh import AXES, PIPELINE_AXES
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.slow import check_slow
from pjit_pipe.schedules import KINDS
from pjit_pipe.simulator import SYNCS

Balance = Literal["flops", "params", "flops+params", "time"]
GradSum = Literal["accumulator", "slices", "slices-compute"]
GRAD_SUMS = ("accumulator", "slices", "slices-compute")
AsyncWeightsMode = Literal["predict", "stash", "latest"]
ASYNC_WEIGHTS = ("predict", "stash", "latest")  # lowering/async_pipeline/async_weights.py MODES
IN_LOOP_OPTIMIZER = ("async-1f1b",)  # kinds whose stages step inside the tick loop


@dataclass(frozen=True)
class PipelineOptions:
    """How a model is pipelined (see `pjit_pipe.pipeline`).

    Attributes:
        stages: P, pipeline stages (the mesh's 'stage' axis).
        microbatches: m, microbatches per data replica per step.
        schedule: the schedule kind, one of `pjit_pipe.schedules.KINDS`.
        mesh: a (data, stage, tensor) mesh from `make_mesh`; None: one replica on the
            first P devices.
        chunks: v, virtual stages per device; None takes the kind's own
            (`schedules.DEFAULT_CHUNKS`: 2 for zb-v and interleaved-1f1b, else 1).
        mem_limit: bound on each worker's in-flight activations, in units of one
            microbatch's activations on one stage (docs/design.md section 3); None:
            the kind's own.
        costs: per-stage F/B/W times that steer zb-v and auto, or "measure": time
            each stage on the devices at first use (the default for "auto").
        optimizer: an optax transformation, for `train_step`.
        remat: True: recompute each stage's forward in its backward (less memory);
            False: store the residuals of the default policy (matmul outputs);
            "auto": at first use, time each virtual stage's F, B, W (or F, BW)
            under every residual policy (lowering.POLICIES) and store per stage
            the fastest one whose pool rows fit those of the default policy
            (frontend/planning/residual_choice.py; `Pipelined.stage_policies`).
        balance: what the stage cut evens out: "flops", "params", "flops+params"
            (the worse of the two, each against its mean stage) or measured "time".
        failed: the (replica, stage) workers that are down; see `with_failures`.
        slow: the slow workers, {(replica, stage): factor >= 1} (stored as sorted
            pairs); part of their microbatches run on peers of their stage
            (see `with_slow`).
        search_time: seconds for the search of a re-routed schedule when workers
            are down.
        max_programs: compiled programs kept per pipeline (least recently used
            go first); each is one (loss function, shapes) combination.
        layers: the stage cut as inclusive (first, last) ranges of the model's
            layers (its clean cut segments), e.g. a planner's `Plan.stages`; None:
            the cutter balances by `balance`.
        split_points: the cut points by path, where stages 1, 2, ... begin (one
            fewer than stages*chunks), e.g. ["model.layers.8", ...]: module
            paths as `Pipelined.describe` shows them (a module deeper than the
            cutter's own choice is cut there too); None: the cutter balances
            by `balance`.
        pack_polish: seconds HiGHS may spend on each window of ticks when it
            polishes the packed tick table of a schedule (not async-1f1b)
            (`pack_ticks(..., polish=)`: 1-9% off the zero-bubble kinds' priced
            step at P=4, up to about 10 s per compile there); 0, the default,
            compiles the greedy's table. A polished table stays within the same
            memory bound (activation units, and each residual pool's rows:
            `ir.memory.MemoryBound`). HiGHS stops at its time limit, so the
            polished table can differ between machines: leave it off on a
            multi-host mesh, where every process must compile the same program.
        skip_nonfinite: whether a training step whose loss or global gradient norm
            is not finite (a NaN or inf batch, an overflow) leaves the parameters and
            optimizer state as they were (see docs/faults.md). None, the default:
            yes, except on async-1f1b, whose stages step inside the tick loop
            before the step's loss is known (there the update is applied); True
            there is refused. False: apply every update.
        tick_sync: the price the tick table is packed for, as the runtime that
            runs it synchronizes ticks (simulator/tick_sync.py): "global" (one
            process: its collectives meet in a rendezvous of every device) or
            "neighbor" (one process per device: each ppermute a send/recv between
            its pairs, which the program then names one by one, each tick only its
            own: `lower(..., pairwise=True)`); None: "neighbor" when
            jax.process_count() > 1 and pack_polish is 0, else "global".
        async_weights: schedule="async-1f1b" only: the weights its stale forwards
            read, "predict" (PipeOptim's weight prediction), "stash" (PipeDream's
            weight stashing) or "latest"; None: "predict" for async-1f1b.
        zero: ZeRO over 'data'. 1 (True): each stage's optax state sharded over
            its D replicas, gradients reduce-scattered and the updated parameters
            all-gathered once per step (lowering/layout/zero.py); an elementwise
            optimizer and an unstaggered schedule. Failure variants run without it,
            each lost slice read from the copy its neighbour keeps. 3: the
            parameters between steps too, all-gathered once per step before the
            tick loop. 0 (False): off. With one replica (data=1) there is nothing
            to shard: the state is whole.
        grad_sum: with zero 1 or 3, "accumulator" (one float32 accumulator of the
            stage's rows, reduce-scattered after the tick loop), "slices" (each
            W's gradient reduce-scattered into float32 slices; not with tied
            weights) or "slices-compute" (those in the compute dtype; docs/memory.md).

    Raises:
        OptionError: an option outside its values (each names the option, the
            values it takes and the fix), skip_nonfinite=True or async_weights
            on a schedule they do not apply to, zero=True with async-1f1b (its
            optimizer steps inside the tick loop), tick_sync="neighbor" with
            pack_polish, or `layers` without one range per stage and one chunk.
        MeshError: `mesh` is no Mesh, its axes are not ('data', 'stage'[,
            'tensor']), or its 'stage' axis is not `stages` long.
        FailurePlanError: `failed` is not a collection of (replica, stage)
            pairs inside the mesh, or leaves a stage without a survivor; a
            `slow` worker outside the mesh or failed, or a factor that is not a
            finite number >= 1.
    """

    stages: int
    microbatches: int
    schedule: str = "1f1b"
    mesh: Mesh | None = None
    chunks: int | None = None
    mem_limit: float | None = None
    costs: Costs | Literal["measure"] | None = None
    optimizer: optax.GradientTransformation | None = None
    remat: bool | Literal["auto"] = False
    balance: Balance = "flops"
    failed: tuple[tuple[int, int], ...] = ()
    slow: tuple[tuple[tuple[int, int], float], ...] = ()
    search_time: float = 2.0
    max_programs: int = 8
    layers: tuple[tuple[int, int], ...] | None = None
    split_points: tuple[str, ...] | None = None
    async_weights: AsyncWeightsMode | None = None
    pack_polish: float = 0.0
    skip_nonfinite: bool | None = None
    tick_sync: str | None = None
    zero: bool | int = False
    grad_sum: GradSum = "accumulator"

    def with_zero(self, zero: int, **changes: Any) -> PipelineOptions:
        """A copy at another ZeRO level; without ZeRO it sums in one accumulator.

        Args:
            zero: the ZeRO level of the copy.
            changes: other options to change, as in `dataclasses.replace`.

        Returns:
            The checked copy.
        """
        grad_sum = self.grad_sum if zero else "accumulator"
        return replace(self, zero=zero, grad_sum=grad_sum, **changes)

    def resolved_tick_sync(self) -> str:
        """How the runtime synchronizes ticks.

        Returns:
            `tick_sync` as given, else "neighbor" on several processes (unless
            polishing), else "global".
        """
        if self.tick_sync is not None:
            return self.tick_sync
        several = jax.process_count() > 1 and not self.pack_polish
        return "neighbor" if several else "global"

    def __post_init__(self) -> None:
        _positive_int("stages", self.stages)
        _positive_int("microbatches", self.microbatches)
        _positive_int("max_programs", self.max_programs)
        if self.chunks is not None:
            _positive_int("chunks", self.chunks, "or None for the schedule kind's own")
        if self.schedule not in KINDS:
            raise OptionError(
                f"schedule: unknown schedule kind {self.schedule!r}; choose one of "
                f"{', '.join(KINDS)}"
            )
        if self.balance not in BALANCE:
            raise OptionError(
                f"balance: expected one of {', '.join(BALANCE)}, got {self.balance!r}"
            )
        if self.costs is not None and self.costs != "measure" and not isinstance(self.costs, Costs):
            raise OptionError(
                f"costs: expected a pjit_pipe.Costs, None or 'measure', got {self.costs!r}"
            )
        for name in ("mem_limit", "search_time"):
            value = getattr(self, name)
            if value is None and name == "mem_limit":
                continue
            if not _is_number(value) or value <= 0:
                raise OptionError(
                    f"{name}: expected a positive number of {_UNITS[name]}, got {value!r}"
                )
        if not _is_number(self.pack_polish) or self.pack_polish < 0:
            raise OptionError(
                f"pack_polish: expected a number of seconds >= 0 (0: no polish), "
                f"got {self.pack_polish!r}"
            )
        if self.tick_sync not in (None, *SYNCS):
            raise OptionError(
                f"tick_sync: expected one of {', '.join(SYNCS)} or None (by the process "
                f"count), got {self.tick_sync!r}"
            )
        if self.tick_sync == "neighbor" and self.pack_polish:
            raise OptionError(
                "tick_sync='neighbor' packs without polishing (pack_polish prices global "
                "lockstep); set pack_polish=0 or tick_sync='global'"
            )
        if not isinstance(self.remat, bool) and self.remat != "auto":
            raise OptionError(f"remat: expected True, False or 'auto', got {self.remat!r}")
        if self.optimizer is not None and not (
            callable(getattr(self.optimizer, "init", None))
            and callable(getattr(self.optimizer, "update", None))
        ):
            raise OptionError(
                f"optimizer: expected an optax GradientTransformation (e.g. optax.adam(1e-3)), "
                f"got {type(self.optimizer).__name__}"
            )
        self._check_skip_nonfinite()
        self._check_async_weights()
        if not isinstance(self.zero, bool | int) or self.zero not in (0, 1, 3):
            raise OptionError(
                f"zero: expected 0 (False), 1 (True: the optax state sharded over data) or "
                f"3 (the parameters too), got {self.zero!r}"
            )
        object.__setattr__(self, "zero", int(self.zero))  # zero=True names zero=1
        name = "zero=True" if self.zero == 1 else f"zero={self.zero}"
        if self.zero and self.schedule in IN_LOOP_OPTIMIZER:
            raise OptionError(
                f"{name} with schedule={self.schedule!r}: its optimizer is staggered into "
                "the tick loop (each stage steps after every microbatch), where ZeRO's "
                "once-per-step reduce-scatter and all-gather do not fit; use a synchronous "
                "schedule such as '1f1b' or 'zb-h1' with zero=True, or zero=False"
            )
        check_grad_sum(self.grad_sum)
        if self.grad_sum != "accumulator" and not self.zero:
            raise OptionError(
                f"grad_sum={self.grad_sum!r} sums each microbatch's gradient into ZeRO's slices; "
                "set zero=1 or zero=3 with it, or keep grad_sum='accumulator'"
            )
        self._check_mesh()
        if self.layers is not None:
            layers = tuple((int(a), int(b)) for a, b in self.layers)
            if len(layers) != self.stages or (self.chunks or 1) != 1:
                raise OptionError(
                    f"layers: {len(layers)} layer ranges for stages={self.stages} "
                    f"(chunks={self.chunks}); give one range per stage, with one chunk"
                )
            object.__setattr__(self, "layers", layers)
        self._check_split_points()
        object.__setattr__(self, "failed", failed_workers(self.failed, self.replicas, self.stages))
        try:
            given = dict(self.slow)
        except (TypeError, ValueError):
            raise FailurePlanError(
                f"slow: expected {{(replica, stage): factor}}, e.g. {{(0, 1): 2.0}}, got {self.slow!r}"
            ) from None
        slow = check_slow(given, self.replicas, self.stages, self.failed)
        object.__setattr__(self, "slow", tuple(sorted((tuple(w), f) for w, f in slow.items())))

    def _check_split_points(self) -> None:
        if self.split_points is None:
            return
        points = self.split_points
        if isinstance(points, str) or not all(isinstance(p, str) and p for p in points):
            raise OptionError(
                f"split_points: expected a list of module paths such as "
                f"['model.layers.8'], got {points!r}"
            )
        if self.layers is not None:
            raise OptionError(
                "split_points and a plan's layers both fix the stage cut; give one of them"
            )
        object.__setattr__(self, "split_points", tuple(points))

    def _check_skip_nonfinite(self) -> None:
        if self.skip_nonfinite not in (None, True, False):
            raise OptionError(
                f"skip_nonfinite: expected True, False or None, got {self.skip_nonfinite!r}"
            )
        if self.skip_nonfinite and self.schedule in IN_LOOP_OPTIMIZER:
            raise OptionError(
                f"skip_nonfinite=True: schedule={self.schedule!r} steps each stage's "
                "optimizer inside the tick loop, before the step's loss and gradient norm "
                "are known, so a non-finite step's update is applied; leave skip_nonfinite "
                "None (or False) there, or use a synchronous schedule such as '1f1b'"
            )

    def _check_async_weights(self) -> None:
        if self.async_weights is None:
            return
        if self.async_weights not in ASYNC_WEIGHTS:
            raise OptionError(
                f"async_weights: expected one of {', '.join(ASYNC_WEIGHTS)} or None, "
                f"got {self.async_weights!r}"
            )
        if self.schedule != "async-1f1b":
            raise OptionError(
                f"async_weights={self.async_weights!r} applies to schedule='async-1f1b' only, "
                f"not {self.schedule!r}; drop async_weights or use schedule='async-1f1b'"
            )

    def _check_mesh(self) -> None:
        if self.mesh is None:
            return
        if not isinstance(self.mesh, Mesh):
            raise MeshError(
                f"mesh: expected a jax Mesh from pjit_pipe.make_mesh(data=D, stage=P, tensor=T), "
                f"got {type(self.mesh).__name__}"
            )
        if tuple(self.mesh.axis_names) not in (AXES, PIPELINE_AXES):
            raise MeshError(
                f"mesh: axes must be {AXES}, got {tuple(self.mesh.axis_names)}; "
                "build it with pjit_pipe.make_mesh(data=D, stage=P, tensor=T)"
            )
        if self.mesh.shape["stage"] != self.stages:
            raise MeshError(
                f"mesh: its 'stage' axis has {self.mesh.shape['stage']} devices, "
                f"but stages={self.stages}; make them equal"
            )

    @property
    def replicas(self) -> int:
        """D, the data-parallel replicas.

        Returns:
            The mesh's 'data' axis size (1 without a mesh).
        """
        return 1 if self.mesh is None else int(self.mesh.shape["data"])


_UNITS = {"mem_limit": "microbatch activations", "search_time": "seconds"}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _positive_int(name: str, value: object, alternative: str = "") -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        extra = f" {alternative}" if alternative else ""
        raise OptionError(f"{name} must be a positive integer{extra}, got {value!r}")


def failed_workers(
    failed: FailurePattern | Sequence[tuple[int, int]], replicas: int, stages: int
) -> tuple[tuple[int, int], ...]:
    """`failed` as sorted (replica, stage) pairs of a replicas x stages mesh.

    Raises FailurePlanError for anything but a collection of pairs (a bare
    pair `(0, 1)` is the common slip: it means `[(0, 1)]`), a worker outside
    the mesh, or a stage whose every replica is down.
    """
    if isinstance(failed, FailurePattern):
        return tuple(
            sorted((w.replica, w.stage) for w in FailurePattern.of(replicas, stages, failed).failed)
        )
    pairs = list(failed) if isinstance(failed, Sequence | set | frozenset) else None
    if pairs is None or not all(_is_pair(w) for w in pairs):
        hint = ""
        if (
            isinstance(failed, tuple | list)
            and len(failed) == 2
            and all(_is_int(v) for v in failed)
        ):
            hint = f"; for the one worker {tuple(failed)} write [{tuple(failed)}]"
        raise FailurePlanError(
            f"failed: expected a list of (replica, stage) pairs, got {failed!r}{hint}"
        )
    pattern = FailurePattern.of(replicas, stages, [tuple(map(int, w)) for w in pairs])
    return tuple(sorted((w.replica, w.stage) for w in pattern.failed))


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_pair(value: object) -> bool:
    return isinstance(value, tuple | list) and len(value) == 2 and all(map(_is_int, value))


def check_grad_sum(grad_sum: str) -> None:
    """Refuse a `grad_sum` that is not one of GRAD_SUMS, by name."""
    if grad_sum not in GRAD_SUMS:
        raise OptionError(f"grad_sum: expected one of {', '.join(GRAD_SUMS)}, got {grad_sum!r}")


__all__ = ["AsyncWeightsMode", "Balance", "GradSum", "PipelineOptions", "failed_workers"]
