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
from pjit_pipe.frontend.auto_plan import AutoPlanned, check_auto_options
from pjit_pipe.frontend.options import AsyncWeightsMode, Balance, PipelineOptions
from pjit_pipe.frontend.pipelined import Pipelined
from pjit_pipe.frontend.plan import planned_options
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
    remat: bool = False,
    balance: Balance = "flops",
    failed: Sequence[tuple[int, int]] = (),
    search_time: float = 2.0,
    max_programs: int = 8,
    plan: Plan | Literal["auto"] | None = None,
    async_weights: AsyncWeightsMode | None = None,
    pack_polish: float = 0.0,
    zero: bool = False,
) -> Pipelined | AutoPlanned | PipelinedClass | Callable[[Any], Any]:
    """Pipeline a Flax model: `pipeline(module, stages=P, microbatches=M, schedule=KIND, ...)`.

    `module` is a linen or NNX Module instance, a Module class (or use
    `@pipeline(stages=..., ...)` as a class decorator: instances are then
    pipelined), or a list of layers (run as nn.Sequential, or nnx.Sequential
    when they are NNX modules). The options are those of `PipelineOptions`,
    which documents and checks them (an OptionError names a bad one).
    `plan`: a planner's `Plan` (see `pjit_pipe.plan_pipeline`): its layer ranges
    are the stage cut, its mapping the mesh and its kind the schedule.
    `plan="auto"`: the planner chooses them at first use, from the live model
    (see `frontend/auto_plan.py`); stages, schedule and mesh, if given, bind it.
    """
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
            zero=zero,
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
        zero=zero,
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
