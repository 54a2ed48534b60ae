"""`pipeline`: turn a Flax module (instance, class or list of layers) into a `Pipelined` model."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import flax.linen as nn
import optax
from flax import nnx
from jax.sharding import Mesh

from pjit_pipe.errors import OptionError
from pjit_pipe.frontend.options import AsyncWeightsMode, Balance, GradSum, PipelineOptions
from pjit_pipe.frontend.pipelined import Pipelined
from pjit_pipe.frontend.planning.auto_plan import AutoPlanned, check_auto_options
from pjit_pipe.frontend.planning.live_plan import planned_options
from pjit_pipe.ir.costs import Costs
from pjit_pipe.planner import Plan

ModuleLike = nn.Module | nnx.Module | Sequence[Any]


class PipelinedClass:
    """A Module class decorated with `pipeline`: instances are `Pipelined` models.

    `module_class` is the undecorated class, for plain unpipelined use.
    """

    def __init__(
        self,
        module_class: type[nn.Module | nnx.Module],
        options: PipelineOptions,
        build: Callable[[Any], Any] | None = None,
    ):
        self.module_class = module_class
        self.options = options
        self.build = build or (lambda module: Pipelined(module, options))  # plan="auto": its own
        functools.update_wrapper(self, module_class, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Pipelined:
        return self.build(self.module_class(*args, **kwargs))


def pipeline(
    module: ModuleLike | type | None = None,
    /,
    *,
    stages: int | None = None,
    microbatches: int,
    schedule: str | None = None,
    mesh: Mesh | None = None,
    chunks: int | None = None,
    mem_limit: float | None = None,
    costs: Costs | Literal["measure"] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    remat: bool | Literal["auto"] = False,
    balance: Balance = "flops",
    failed: Sequence[tuple[int, int]] = (),
    search_time: float = 2.0,
    max_programs: int = 8,
    plan: Plan | Literal["auto"] | None = None,
    async_weights: AsyncWeightsMode | None = None,
    pack_polish: float = 0.0,
    skip_nonfinite: bool | None = None,
    zero: bool | int = False,
    grad_sum: GradSum = "accumulator",
    split_points: Sequence[str] | None = None,
) -> Pipelined | AutoPlanned | PipelinedClass | Callable[[Any], Any]:
    """Pipeline a Flax model: `pipeline(module, stages=P, microbatches=M, schedule=KIND, ...)`.

    The options are those of `PipelineOptions`, which documents each in full
    and checks them all here, before any model is traced or compiled.

    Args:
        module: A linen or NNX Module instance; a Module class (or use
            `@pipeline(stages=..., ...)` as a class decorator: instances are
            then pipelined); a list of layers (run as nn.Sequential, or
            nnx.Sequential when they are NNX modules); or None, for a decorator
            of a module given later.
        stages: P, pipeline stages (the mesh's 'stage' axis); required unless
            `plan` gives them.
        microbatches: m, microbatches per data replica per step.
        schedule: The schedule kind, one of `pjit_pipe.schedules.KINDS`;
            None: "1f1b" (or the plan's).
        mesh: A (data, stage) mesh from `make_mesh`; None: one replica on the
            first P devices (or the plan's mapping).
        chunks: v, virtual stages per device; None takes the kind's own.
        mem_limit: Bound on each worker's in-flight activations, in units of
            one microbatch's activations on one stage; None: the kind's own.
        costs: Per-stage F/B/W times that steer zb-v and auto, or "measure"
            (time each stage on the devices at first use).
        optimizer: An optax transformation, for `train_step`.
        remat: Recompute each stage's forward in its backward (less memory);
            "auto": store per stage the residuals of the policy measured fastest
            within the default's memory (`Pipelined.stage_policies`).
        balance: What the stage cut evens out: "flops", "params" or "time".
        failed: The (replica, stage) workers that are down.
        search_time: Seconds for the search of a re-routed schedule when
            workers are down.
        max_programs: Compiled programs kept per pipeline.
        plan: A planner's `Plan` (see `pjit_pipe.plan_pipeline`): its layer
            ranges are the stage cut, its mapping the mesh and its kind the
            schedule. "auto": the planner chooses them at first use, from the
            live model (see `frontend/planning/auto_plan.py`); stages,
            schedule and mesh, if given, bind it.
        async_weights: schedule="async-1f1b" only: the weights its stale
            forwards read, "predict", "stash" or "latest".
        pack_polish: Seconds HiGHS may spend polishing each window of the
            packed tick table; 0 compiles the greedy's table.
        skip_nonfinite: Whether a step whose loss or gradient norm is not
            finite leaves the state as it was; None: yes, except on async-1f1b.
        zero: Shard each stage's optimizer state over its data-parallel
            replicas (ZeRO-1: True or 1; docs/memory.md).
        grad_sum: With zero, "accumulator" (one reduce-scatter a step) or
            "slices" (one a microbatch, into 1/D of the bytes) or "slices-compute"
            (those in the compute dtype: bf16 sums; docs/memory.md).
        split_points: The cut points by module path, where stages 1, 2, ...
            begin (["model.layers.8", ...]); None: the cutter balances.

    Returns:
        A `Pipelined` model for a module instance or list of layers; with
        plan="auto", an `AutoPlanned` one that plans at first use; for a Module
        class, a class-like whose instances are pipelined; for module=None, a
        decorator that applies these options to what it is given.

    Raises:
        OptionError: An option has a value it does not accept, `stages` is
            missing without a plan, `plan` is neither "auto" nor a Plan, an
            option disagrees with the plan, split_points comes with a plan, or
            an option plan="auto" cannot honour (a schedule it cannot plan,
            chunks other than 1, failed workers).
        MeshError: The mesh is not a (data, stage) mesh from `make_mesh`, its
            stage axis differs from `stages`, or it differs from the plan's.
        FailurePlanError: `failed` is not a list of (replica, stage) pairs,
            names a worker outside the mesh, or takes down every replica of a
            stage.
    """
    if split_points is not None and plan is not None:
        raise OptionError(
            "split_points and plan both fix the stage cut; give split_points or plan, not both"
        )
    if isinstance(plan, str):
        if plan != "auto":
            raise OptionError(
                f"plan: expected 'auto', a pjit_pipe.planner.Plan or None, got {plan!r}"
            )
        settings = dict(
            microbatches=microbatches,
            mem_limit=mem_limit,
            costs=costs,
            optimizer=optimizer,
            remat=remat,
            balance=balance,
            search_time=search_time,
            max_programs=max_programs,
            async_weights=async_weights,
            pack_polish=pack_polish,
            skip_nonfinite=skip_nonfinite,
            zero=zero,
            grad_sum=grad_sum,
        )
        check_auto_options(stages, schedule, mesh, chunks, failed)
        checked = PipelineOptions(stages=1, **settings)  # the other options fail here, not later
        return _wrap(
            module,
            checked,
            lambda m: AutoPlanned(
                m,
                lambda p: pipeline(m, plan=p, **settings),
                microbatches,
                stages,
                schedule,
                mesh,
                optimizer is not None,
            ),
        )
    layers = None
    if plan is not None:
        stages, schedule, mesh = planned_options(plan, stages, schedule, mesh)
        layers = plan.stages
    if stages is None:
        raise OptionError("stages: required (the pipeline's stage count P), or give plan=")
    options = PipelineOptions(
        stages=stages,
        microbatches=microbatches,
        schedule="1f1b" if schedule is None else schedule,
        mesh=mesh,
        chunks=chunks,
        mem_limit=mem_limit,
        costs=costs,
        optimizer=optimizer,
        remat=remat,
        balance=balance,
        failed=failed,  # type: ignore[arg-type]  # PipelineOptions makes it a tuple
        search_time=search_time,
        max_programs=max_programs,
        layers=layers,
        async_weights=async_weights,
        pack_polish=pack_polish,
        skip_nonfinite=skip_nonfinite,
        zero=zero,
        grad_sum=grad_sum,
        split_points=split_points,
    )
    return pipeline_with(module, options)


def pipeline_with(
    module: ModuleLike | type | None, options: PipelineOptions
) -> Pipelined | PipelinedClass | Callable[[Any], Any]:
    """`pipeline` for options already gathered in a `PipelineOptions`."""
    return _wrap(module, options, lambda m: Pipelined(m, options))


def _wrap(module: ModuleLike | type | None, options: PipelineOptions, build: Callable[[Any], Any]):
    """`build(module instance)`, or a decorator / class whose instances get it."""
    if module is None:
        return lambda m: _wrap(m, options, build)
    if isinstance(module, type) and issubclass(module, nn.Module | nnx.Module):
        return PipelinedClass(module, options, build)
    if isinstance(module, list | tuple):
        nnx_layers = any(isinstance(m, nnx.Module) for m in module)
        module = nnx.Sequential(*module) if nnx_layers else nn.Sequential(list(module))
    return build(module)
