"""The errors pjit_pipe raises for a mistake in its input: one class per kind of mistake.

Each class says, in its docstring, what kind of mistake it stands for and what
to do about it; each message names the offending argument, the values it
accepts and the fix. Catch `PjitPipeError` for any of them. Every class is
also a `ValueError` (the bad input is a value), so code written against the
plain `ValueError`s of earlier versions keeps working.

This module imports nothing from pjit_pipe: every layer, `ir` included, may
raise these.
"""

from __future__ import annotations


class PjitPipeError(ValueError):
    """Raised for any mistake in pjit_pipe's input; the base class of every error here.

    The message says what to change.
    """


class ScheduleError(PjitPipeError):
    """Raised when a schedule, or a request for one, is invalid.

    For example a kind that does not exist, chunks or a memory limit that kind
    cannot meet, or an op out of order. The message names the parameter or the
    op; change that parameter, or use schedule="auto", which meets any memory
    limit >= 1.
    """


class OptionError(PjitPipeError):
    """Raised when an option of `pipeline()` / `PipelineOptions` (or its CLI flag) has a bad value.

    The message names the option, the values it accepts and the fix.
    """


class MeshError(OptionError):
    """Raised when the mesh does not fit the pipeline.

    Build it with `pjit_pipe.make_mesh(data=D, stage=P)` with P equal to
    `stages`, on at most `len(jax.devices())` devices.
    """


class FailurePlanError(ScheduleError):
    """Raised when a set or plan of failed workers cannot be run.

    For example a worker outside the mesh, every replica of a stage down (its
    parameters are lost; keep one replica of each stage alive), a rejoin of a
    worker that is not down, or a failure after the last step. Failed workers
    are (replica, stage) pairs, e.g. `with_failures([(0, 1)])`.
    """


class BatchError(PjitPipeError):
    """Raised when a batch does not fit the pipeline.

    Every leaf of x and y needs the same leading (global batch) dimension,
    divisible by data replicas x microbatches.
    """


class RngError(PjitPipeError):
    """Raised when the model draws random numbers (dropout) but the step got no usable key.

    Either no key was given or the keys are not `jax.random.key`s: pass
    `rngs=jax.random.key(...)` or a dict {stream: key} to the step, or make the
    model deterministic.
    """


class LossFnError(PjitPipeError):
    """Raised when the loss function returns something other than a scalar mean loss or a pair.

    The pair is (loss_sum, weight); with has_aux=True the loss function returns
    ((loss...), aux).
    """


class OptimizerError(PjitPipeError):
    """Raised when the optimizer is missing or cannot run stage by stage.

    Missing: train_step needs `pipeline(..., optimizer=...)`. Not stage by
    stage: a mask or label *tree* for the whole model (give optax.masked /
    multi_transform a function of the parameters), or a state whose
    per-parameter parts are not shaped like the parameters.
    """


class CutError(PjitPipeError):
    """Raised when the model cannot be cut into the requested stages.

    Either it has fewer cut points than stages (use fewer stages or add
    `pjit_pipe.boundary()` markers), or the parameters do not match the cut.
    """


class JaxprError(CutError):
    """Raised when the stage cutter cannot read an equation of the model's jaxpr.

    The installed JAX gives the equation params of a form pjit_pipe does not
    read. The message names the primitive and `jax.__version__`; use a
    supported JAX release (0.10.2 to 0.12.x) or report the two.
    """


class StateError(PjitPipeError):
    """Raised when a training state cannot be moved into a pipeline's device layout.

    No live device holds some stage's rows, or the state belongs to another
    model.
    """


class CheckpointError(PjitPipeError):
    """Raised when a checkpoint directory or checkpoint cannot be used.

    A directory that is a file or not writable, a step that does not exist, data
    that is not JSON, or no readable checkpoint at all. The message names the
    directory or step and what to change; nothing is written.
    """


class PlotError(PjitPipeError):
    """Raised when a chart is asked for in a format it is not written in: use .png or .svg."""


class SplitError(MeshError):
    """Raised when a weight's annotation cannot be split over the mesh's 'tensor' axis.

    A dimension the tensor size does not divide, a logical axis name the rules
    do not map, or a mesh axis other than 'tensor'. The message names the
    weight, the dimension and the fix."""


__all__ = [
    "BatchError",
    "CheckpointError",
    "CutError",
    "FailurePlanError",
    "JaxprError",
    "LossFnError",
    "MeshError",
    "OptimizerError",
    "OptionError",
    "PjitPipeError",
    "PlotError",
    "RngError",
    "ScheduleError",
    "SplitError",
    "StateError",
]
