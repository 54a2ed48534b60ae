"""`pipeline(module, ..., plan="auto")`: the planner chooses the pipeline at first use.

The planner needs the layers' costs, which need the batch shapes, which are
known only when the model first meets a batch: where a `Pipelined` cuts the
model. So `AutoPlanned` holds the module and the options, and at the first
call that sees a global batch (value_and_grad, forward, a train step's init,
cut, describe, or `plan_for`) runs `frontend.plan.auto_plan` (profile the
layers, probe the devices, plan every allowed replica count) and builds the
`Pipelined` of the chosen plan, to which it then hands every call. The plan is
kept for later batches: re-planning would recompile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh

from pjit_pipe.errors import MeshError, OptimizerError, OptionError
from pjit_pipe.frontend.cutter.adapters import as_model
from pjit_pipe.frontend.mesh import AXES, PIPELINE_AXES
from pjit_pipe.frontend.planning.live_plan import AutoPlan, auto_plan
from pjit_pipe.frontend.rngs import with_step_rngs
from pjit_pipe.frontend.train_step import TrainStep
from pjit_pipe.planner import PLANNABLE_KINDS, Plan

if TYPE_CHECKING:
    from pjit_pipe.frontend.pipelined import LossFn, Pipelined


def check_auto_options(
    stages: int | None,
    schedule: str | None,
    mesh: Mesh | None,
    chunks: int | None,
    failed: Sequence[tuple[int, int]],
) -> None:
    """Options that plan="auto" cannot honour fail here, naming the option and the fix."""
    if schedule is not None and schedule not in PLANNABLE_KINDS:
        raise OptionError(
            f"schedule: plan='auto' places one contiguous stage per device and plans "
            f"{', '.join(PLANNABLE_KINDS)}; {schedule!r} is not one of them: pick one or "
            "leave schedule out (the planner chooses)"
        )
    if chunks not in (None, 1):
        raise OptionError(
            f"chunks: plan='auto' runs one chunk per device, got chunks={chunks}; leave it out"
        )
    if failed:
        raise OptionError(
            "failed: plan='auto' chooses the mesh at first use, so its workers are not known "
            "yet; run the planned pipeline's with_failures([...]) after its first step"
        )
    if mesh is not None and (
        not isinstance(mesh, Mesh)
        or tuple(getattr(mesh, "axis_names", ())) not in (AXES, PIPELINE_AXES)
    ):
        raise MeshError(
            f"mesh: expected a {AXES} mesh from pjit_pipe.make_mesh(data=D, stage=P), got "
            f"{type(mesh).__name__}; with plan='auto' its devices are planned over"
        )
    if mesh is not None and stages is not None and mesh.shape["stage"] != stages:
        raise MeshError(
            f"stages: {stages} differs from the mesh's stage axis ({mesh.shape['stage']}); "
            "with plan='auto' give one of them, or neither (the planner chooses)"
        )


class AutoPlanned:
    """A pipeline that the planner cuts, places and schedules at first use.

    `build(plan)` makes the `Pipelined` of a plan (`pipeline(module, plan=plan,
    ...)` with the other options). stages, schedule: fixed, or chosen when None.
    mesh: its devices are the ones planned over and its shape fixes D x P (the
    planner arranges the devices); None: every local device, D and P chosen.
    Before planning, `plan` and `auto_plan` are None and the attributes of a
    `Pipelined` (mesh, schedule, ...) raise an AttributeError saying so.
    """

    def __init__(
        self,
        module: Any,
        build: Callable[[Plan], Pipelined],
        microbatches: int,
        stages: int | None,
        schedule: str | None,
        mesh: Mesh | None,
        has_optimizer: bool,
    ):
        self.module = module
        self.model = with_step_rngs(as_model(module))
        self.microbatches = microbatches
        self._build = build
        self._stages, self._schedule = stages, schedule
        self._pool = list(jax.devices() if mesh is None else mesh.devices.flat)
        self._replicas = None if mesh is None else int(mesh.shape["data"])
        if mesh is not None and stages is None:
            self._stages = int(mesh.shape["stage"])
        if self._stages is not None and self._stages * (self._replicas or 1) > len(self._pool):
            raise OptionError(
                f"stages: {self._stages} stages need more than the {len(self._pool)} devices "
                "plan='auto' can use; ask for fewer stages or add devices"
            )
        self._has_optimizer = has_optimizer
        self.auto_plan: AutoPlan | None = None
        self._planned: Pipelined | None = None

    @property
    def plan(self) -> Plan | None:
        """The chosen plan (mapping indices into jax.devices()), None before first use."""
        return None if self.auto_plan is None else self.auto_plan.plan

    def plan_for(self, params: Any, x: Any) -> Pipelined:
        """The planned pipeline; plans it for global batches like `x` on first call."""
        if self._planned is None:
            self.auto_plan = auto_plan(
                self.model,
                params,
                x,
                self.microbatches,
                self._pool,
                self._stages,
                self._replicas,
                self._schedule,
            )
            self._planned = self._build(self.auto_plan.plan)
        return self._planned

    def __getattr__(self, name: str) -> Any:
        # Only called for names this object lacks: those of the planned Pipelined.
        planned = self.__dict__.get("_planned")
        if name.startswith("__") or planned is None:
            raise AttributeError(
                f"{name}: a plan='auto' pipeline is made at first use; call value_and_grad, "
                "forward, cut, describe or plan_for(params, x) with a batch first"
            )
        return getattr(planned, name)

    # ---- the Pipelined API: plan on first sight of a batch, then delegate ----

    def init(self, rng: jax.Array, x: Any) -> Any:
        """Plain Flax variables, as `Pipelined.init` (needs no plan)."""
        return self.model.init(rng, x)

    def apply(self, params: Any, x: Any) -> Any:
        """The unpipelined forward pass, as `Pipelined.apply` (needs no plan)."""
        return self.model.apply(params, x)

    def cut(self, params: Any, x: Any):
        return self.plan_for(params, x).cut(params, x)

    def describe(self, params: Any, x: Any) -> str:
        """The chosen plan (and the replica counts it beat), then the stage cut."""
        cut = self.plan_for(params, x).describe(params, x)
        assert self.auto_plan is not None
        return f"{self.auto_plan.describe()}\n{cut}"

    def value_and_grad(self, loss_fn: LossFn, has_aux: bool = False) -> Callable[..., Any]:
        """As `Pipelined.value_and_grad`; the first call plans the pipeline."""

        def value_and_grad(params: Any, x: Any, y: Any, rngs: Any = None) -> tuple[Any, Any]:
            return self.plan_for(params, x).value_and_grad(loss_fn, has_aux)(params, x, y, rngs)

        return value_and_grad

    def forward(self, params: Any, x: Any, rngs: Any = None) -> Any:
        return self.plan_for(params, x).forward(params, x, rngs)

    def program(
        self, params: Any, x: Any, y: Any, loss_fn: LossFn, has_aux: bool = False, rngs=None
    ):
        return self.plan_for(params, x).program(params, x, y, loss_fn, has_aux, rngs)

    def train_step(self, loss_fn: LossFn, donate: bool = True) -> TrainStep:
        """As `Pipelined.train_step`; its init (or first step) plans the pipeline."""
        if not self._has_optimizer:
            raise OptimizerError(
                "train_step needs an optax optimizer: pass pipeline(..., "
                "optimizer=optax.adam(1e-3)) (any optax transformation)"
            )
        return TrainStep(self, loss_fn, donate)  # type: ignore[arg-type]  # duck-typed
