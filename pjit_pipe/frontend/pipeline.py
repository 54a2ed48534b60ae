"""`pipeline`: turn a Flax module (instance, class or list of layers) into a `Pipelined` model."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
from flax import nnx

from pjit_pipe.frontend.pipelined import Pipelined


class PipelinedClass:
    """A Module class decorated with `pipeline`: instances are `Pipelined` models.

    `module_class` is the undecorated class, for plain unpipelined use.
    """

    def __init__(self, module_class: type[nn.Module | nnx.Module], options: dict[str, Any]):
        self.module_class = module_class
        self.options = options
        functools.update_wrapper(self, module_class, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Pipelined:
        return Pipelined(self.module_class(*args, **kwargs), **self.options)


def pipeline(
    module: nn.Module | nnx.Module | type | Sequence[Any] | None = None,
    /,
    **options: Any,
) -> Any:
    """Pipeline a Flax model: `pipeline(module, stages=P, microbatches=M, schedule=KIND, ...)`.

    `module` is a linen or NNX Module instance, a Module class (or use
    `@pipeline(stages=..., ...)` as a class decorator: instances are then
    pipelined), or a list of layers (run as nn.Sequential, or nnx.Sequential
    when they are NNX modules).

    Options: stages (P), microbatches (m per replica), schedule (one of
    pjit_pipe.schedules.KINDS), mesh (from make_mesh; default one replica on
    the first P devices), chunks (v, virtual stages per device), mem_limit,
    costs (Costs for the schedule generators, or 'measure': time each stage's
    F, B, W on the devices at first use; the default for schedule='auto'),
    optimizer (optax, for train_step), remat (recompute forwards in the
    backward), balance ('flops', 'params' or 'time': how stages are balanced), failed ((replica, stage) workers
    that are down; see `Pipelined.with_failures`), search_time (seconds for
    the re-routed schedule search).
    """
    if module is None:
        return lambda m: pipeline(m, **options)
    if isinstance(module, type) and issubclass(module, nn.Module | nnx.Module):
        return PipelinedClass(module, options)
    if isinstance(module, list | tuple):
        nnx_layers = any(isinstance(m, nnx.Module) for m in module)
        module = nnx.Sequential(*module) if nnx_layers else nn.Sequential(list(module))
    return Pipelined(module, **options)
