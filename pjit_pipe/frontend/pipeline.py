"""`pipeline`: turn a Flax module into a pipelined model with the module's own API.

The user keeps plain Flax parameters (`module.init` for linen, the module's
nnx.Param state for NNX; see `adapters.py`); the pipelined object
cuts the model into stages on first use (per input shape), splits parameters
per stage for the lowering and merges gradients back, so everything the user
sees or checkpoints has the module's own tree structure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pjit_pipe.failures import FailurePattern
from pjit_pipe.frontend.adapters import as_model
from pjit_pipe.frontend.cut import BALANCE, StageCut, cut_module
from pjit_pipe.frontend.mesh import AXES, make_mesh
from pjit_pipe.frontend.opt_state import check_opt_layout, merge_opt_state, split_opt_state
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.topology import Topology
from pjit_pipe.passes.reroute import schedule_with_failures
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator.costs import Costs

LossFn = Callable[[Any, Any], jax.Array]


@flax.struct.dataclass
class TrainState:
    """Training state of a pipelined model.

    params: the module's own variables {'params': ...} (layout-free: save them).
    opt_state: `optimizer.init(params)`, in the module's layout too (the
        pipeline splits it by stage for each step and merges it back).
    step: number of optimizer steps taken.
    """

    params: Any
    opt_state: Any
    step: int = flax.struct.field(pytree_node=False, default=0)


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _leading(name: str, tree: Any) -> int:
    dims = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(tree)}
    if len(dims) != 1 or None in dims:
        raise ValueError(f"{name}: every leaf needs the same leading batch dimension, got {dims}")
    return dims.pop()


class Pipelined:
    """A Flax module run as a pipeline (see `pipeline` for the options)."""

    def __init__(
        self,
        module: nn.Module | nnx.Module,
        *,
        stages: int,
        microbatches: int,
        schedule: str = "1f1b",
        mesh: Mesh | None = None,
        chunks: int = 1,
        mem_limit: float | None = None,
        costs: Costs | str | None = None,
        optimizer: optax.GradientTransformation | None = None,
        remat: bool = False,
        balance: str = "flops",
        failed: Sequence[tuple[int, int]] = (),
        search_time: float = 2.0,
    ):
        self.module = module
        self.model = as_model(module)
        self.stages = _positive("stages", stages)
        self.microbatches = _positive("microbatches", microbatches)
        self.chunks = _positive("chunks", chunks)
        if balance not in BALANCE:
            raise ValueError(f"balance: expected one of {', '.join(BALANCE)}, got {balance!r}")
        self.mesh = make_mesh(data=1, stage=self.stages) if mesh is None else mesh
        if tuple(self.mesh.axis_names) != AXES:
            raise ValueError(f"mesh: axes must be {AXES}, got {tuple(self.mesh.axis_names)}")
        if self.mesh.shape["stage"] != self.stages:
            raise ValueError(
                f"mesh: its 'stage' axis has {self.mesh.shape['stage']} devices, "
                f"but stages={self.stages}"
            )
        self.replicas = self.mesh.shape["data"]
        self.failed = FailurePattern.of(self.replicas, self.stages, failed)
        # costs="measure" (the default for schedule="auto"): the schedule is made
        # again on first use, with the stage costs measured from the model.
        if costs is None and schedule == "auto":
            costs = "measure"
        if isinstance(costs, str) and costs != "measure":
            raise ValueError(f"costs: expected a Costs, None or 'measure', got {costs!r}")
        self.measure = costs == "measure"
        self.measured_costs: Costs | None = None
        self.stage_times = None  # measure.StageTimes, once measured
        self._schedule_args = (schedule, mem_limit, search_time)
        self._make_schedule(None if self.measure else costs)
        # The mesh the compiled program runs on: `mesh`, or the survivors' devices.
        self.device_mesh: Mesh = Topology.of(self.mesh, self.failed.failed).mesh
        self.optimizer = optimizer
        self.remat = remat
        self.balance = balance
        self._options = dict(
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            mesh=mesh,
            chunks=chunks,
            mem_limit=mem_limit,
            costs=costs,
            optimizer=optimizer,
            remat=remat,
            balance=balance,
            failed=tuple(sorted(self.failed.failed)),
            search_time=search_time,
        )
        self._cuts: dict[Any, StageCut] = {}
        self._steps: dict[Any, Any] = {}

    def _make_schedule(self, costs: Costs | None) -> None:
        schedule, mem_limit, search_time = self._schedule_args
        if self.failed.failed:
            self.schedule: Schedule = schedule_with_failures(
                schedule,
                self.stages,
                self.microbatches,
                self.replicas,
                self.failed,
                costs,
                mem_limit,
                self.chunks,
                time_limit=search_time,
            )
        else:
            self.schedule = make_schedule(
                schedule,
                self.stages,
                self.microbatches,
                self.chunks,
                costs,
                mem_limit,
                self.replicas,
            )

    def measure_costs(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> Costs:
        """Per-stage F/B/W (ms) measured on this pipeline's devices for these shapes
        (cached per model, loss, shapes and devices; see `measure.py`)."""
        from pjit_pipe.frontend.measure import measure_stage_times

        cut = self.cut(params, x)
        n = self.replicas * self.microbatches
        mb = lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // n, *np.shape(a)[1:]), a.dtype)  # noqa: E731
        x_mb, y_mb = jax.tree.map(mb, x), jax.tree.map(mb, y)
        stage_params = cut.split(params)
        key = (
            id(self.module),
            loss_fn,
            str(jax.tree.map(lambda a: (a.shape, a.dtype), (x_mb, y_mb))),
        )
        key += (str(jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), stage_params)),)
        times = measure_stage_times(
            cut.stage_fns(), loss_fn, stage_params, x_mb, y_mb, self.mesh, key=key
        )
        self.stage_times = times
        return times.costs(self.stages)

    def with_options(self, **changes: Any) -> Pipelined:
        """A copy with some options changed (e.g. another mesh or optimizer)."""
        return Pipelined(self.module, **{**self._options, **changes})

    def with_failures(self, failed: Sequence[tuple[int, int]]) -> Pipelined:
        """The same model and API on the surviving devices: `failed` lists the
        (replica, stage) workers that are down (an empty list: the fault-free
        pipeline). Their microbatches run on peers of the same stage, so the
        loss and gradients are those of the fault-free step on the same batch.

        Raises ScheduleError naming the stage when a stage has no survivor.
        """
        variant = self.with_options(failed=tuple(failed))
        variant._cuts = self._cuts  # same module and stage count: share the cuts
        return variant

    # ---- the plain module API ----

    def init(self, rng: jax.Array, x: Any) -> Any:
        """linen: `module.init(rng, x)`, plain Flax variables. NNX: the module's own
        nnx.Param state as a pure dict (an NNX module is initialized when built)."""
        return self.model.init(rng, x)

    def apply(self, params: Any, x: Any) -> Any:
        """The unpipelined forward pass (`module.apply`), for evaluation and sampling."""
        return self.model.apply(params, x)

    # ---- cutting ----

    def _batch(self, x: Any, y: Any) -> int:
        n = self.replicas * self.microbatches
        batch = _leading("x", x)
        if _leading("y", y) != batch:
            raise ValueError(f"y: batch size {_leading('y', y)} differs from x's {batch}")
        if batch % n:
            raise ValueError(
                f"x: global batch {batch} is not divisible by data*microbatches = "
                f"{self.replicas}*{self.microbatches} = {n}"
            )
        return batch // n

    def cut(self, params: Any, x: Any) -> StageCut:
        """The stage cut for this parameter tree and global batch `x` (cached)."""
        mb = _leading("x", x) // (self.replicas * self.microbatches)
        x_mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((mb, *np.shape(a)[1:]), a.dtype), x)
        leaves, treedef = jax.tree.flatten(self.model.params(params))
        key = (jax.tree.structure(x_mb), tuple(jax.tree.leaves(x_mb)), treedef)
        key += tuple((np.shape(a), jnp.result_type(a)) for a in leaves)
        if key not in self._cuts:
            self._cuts[key] = cut_module(
                self.model, params, x_mb, self.schedule.num_virtual_stages, self.balance
            )
        return self._cuts[key]

    def _step(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> tuple[StageCut, Any]:
        from pjit_pipe.lowering import lower  # the compiler is heavy; load it on first use

        self._batch(x, y)
        if self.measure and self.measured_costs is None:
            self.measured_costs = self.measure_costs(params, x, y, loss_fn)
            self._make_schedule(self.measured_costs)
        cut = self.cut(params, x)
        avals = jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), (x, y))
        key = (id(cut), loss_fn, str(avals))
        if key not in self._steps:
            self._steps[key] = lower(
                self.schedule,
                cut.stage_fns(),
                loss_fn,
                self.mesh,
                cut.split(params),
                x,
                y,
                optimizer=self.optimizer,
                remat=self.remat,
            )
        return cut, self._steps[key]

    # ---- training ----

    def value_and_grad(self, loss_fn: LossFn) -> Callable[[Any, Any, Any], tuple[jax.Array, Any]]:
        """f(params, x, y) -> (mean loss over the global batch, grads shaped like params).

        loss_fn(outputs, y_mb) is the mean loss of one microbatch.
        """

        def value_and_grad(params: Any, x: Any, y: Any) -> tuple[jax.Array, Any]:
            cut, step = self._step(params, x, y, loss_fn)
            params = self.place(params)
            loss, grads = step.value_and_grad(cut.split(params), x, y)
            return loss, cut.merge(grads)

        return value_and_grad

    def place(self, tree: Any) -> Any:
        """`tree` replicated on the devices this pipeline runs on (a no-op when it is).

        Switching to or from a failure variant moves the state this way: a
        rejoining device gets its copy from a live one."""
        return jax.device_put(tree, NamedSharding(self.device_mesh, PartitionSpec()))

    def train_step(self, loss_fn: LossFn) -> TrainStep:
        """A training step for `loss_fn` with the pipeline's optax optimizer."""
        if self.optimizer is None:
            raise ValueError("train_step: pipeline(..., optimizer=...) needs an optax optimizer")
        return TrainStep(self, loss_fn)


class TrainStep:
    """step(state, (x, y)) -> (new state, loss before the update); step.init(params, batch)."""

    def __init__(self, pipelined: Pipelined, loss_fn: LossFn):
        self.pipelined = pipelined
        self.loss_fn = loss_fn

    def init(self, params: Any, batch: tuple[Any, Any]) -> TrainState:
        """A fresh TrainState; `batch` is an example (x, y) that fixes the stage cut."""
        model = self.pipelined.model
        params = model.variables(model.params(params))  # e.g. an nnx.State -> its pure dict
        cut, _ = self.pipelined._step(params, *batch, self.loss_fn)
        check_opt_layout(cut, self.pipelined.optimizer, params)
        state = TrainState(params=params, opt_state=self.pipelined.optimizer.init(params))
        # Place it as train steps return it (replicated on the mesh), so the
        # second step does not compile again for a new input layout.
        return self.pipelined.place(state)

    def __call__(self, state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, jax.Array]:
        x, y = batch
        cut, step = self.pipelined._step(state.params, x, y, self.loss_fn)
        state, (x, y) = self.pipelined.place((state, (x, y)))
        opt_stages = split_opt_state(cut, state.opt_state, state.params)
        params, opt_stages, loss = step.train_step(cut.split(state.params), opt_stages, x, y)
        params = cut.merge(params)
        opt_state = merge_opt_state(cut, opt_stages, state.opt_state, params)
        return TrainState(params, opt_state, state.step + 1), loss

    def compile(self, state: TrainState, batch: tuple[Any, Any]) -> float:
        """Compile ahead of time for states and batches shaped like these (arrays or
        ShapeDtypeStructs); returns the seconds it took."""
        x, y = batch
        cut, step = self.pipelined._step(state.params, x, y, self.loss_fn)
        sharding = NamedSharding(self.pipelined.device_mesh, PartitionSpec())
        placed = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=sharding),
            (state, x, y),
        )
        state, x, y = placed
        opt_stages = split_opt_state(cut, state.opt_state, state.params)
        return step.compile_train_step(cut.split(state.params), opt_stages, x, y)


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
