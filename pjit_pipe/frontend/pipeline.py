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

    def __init__(self, module_class: type[nn.Module | nnx.Module], options: PipelineOptions):
        self.module_class = module_class
        self.options = options
        functools.update_wrapper(self, module_class, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Pipelined:
        return Pipelined(self.module_class(*args, **kwargs), self.options)


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
    plan: Plan | None = None,
    async_weights: AsyncWeightsMode | None = None,
) -> Pipelined | PipelinedClass | Callable[[Any], Any]:
    """Pipeline a Flax model: `pipeline(module, stages=P, microbatches=M, schedule=KIND, ...)`.

    `module` is a linen or NNX Module instance, a Module class (or use
    `@pipeline(stages=..., ...)` as a class decorator: instances are then
    pipelined), or a list of layers (run as nn.Sequential, or nnx.Sequential
    when they are NNX modules). The options are those of `PipelineOptions`,
    which documents and checks them (an OptionError names a bad one).
    `plan`: a planner's `Plan` (see `pjit_pipe.plan_pipeline`): its layer ranges
    are the stage cut, its mapping the mesh and its kind the schedule.
    """
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
    )
    return pipeline_with(module, options)


def pipeline_with(
    module: ModuleLike | type | None, options: PipelineOptions
) -> Pipelined | PipelinedClass | Callable[[Any], Any]:
    """`pipeline` for options already gathered in a `PipelineOptions`."""
    if module is None:
        return lambda m: pipeline_with(m, options)
    if isinstance(module, type) and issubclass(module, nn.Module | nnx.Module):
        return PipelinedClass(module, options)
    if isinstance(module, list | tuple):
        nnx_layers = any(isinstance(m, nnx.Module) for m in module)
        module = nnx.Sequential(*module) if nnx_layers else nn.Sequential(list(module))
    return Pipelined(module, options)
