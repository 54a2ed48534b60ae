"""`pipeline`: turn a Flax module into a pipelined model with the module's own API.

The user keeps plain Flax parameters (`module.init` for linen, the module's
nnx.Param state for NNX; see `adapters.py`); the pipelined object
cuts the model into stages on first use (per input shape), splits parameters
per stage for the lowering and merges gradients back, so everything the user
sees or checkpoints has the module's own tree structure.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pjit_pipe.frontend.adapters import as_model
from pjit_pipe.frontend.cut import BALANCE, StageCut, cut_module
from pjit_pipe.frontend.mesh import AXES, make_mesh
from pjit_pipe.frontend.opt_state import check_opt_layout
from pjit_pipe.frontend.rngs import step_rngs, with_step_rngs
from pjit_pipe.frontend.state import StateView, TrainState
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.topology import Topology
from pjit_pipe.passes.reroute import schedule_with_failures
from pjit_pipe.schedules import make_schedule

LossFn = Callable[[Any, Any], jax.Array]


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
        async_weights: str | None = None,
    ):
        if async_weights is not None and schedule != "async-1f1b":
            raise ValueError(
                f"async_weights={async_weights!r} applies to schedule='async-1f1b' only, "
                f"not {schedule!r}; drop async_weights or use schedule='async-1f1b'"
            )
        self.async_weights = async_weights  # see lowering/async_weights.py
        self.module = module
        self.model = with_step_rngs(as_model(module))
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
            async_weights=async_weights,
        )
        self._cuts: dict[Any, StageCut] = {}
        self._steps: dict[Any, Any] = {}
        self._views: dict[int, StateView] = {}  # per compiled step: its state view

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
        """The unpipelined forward pass (`module.apply`), for evaluation and sampling at
        any batch size; `forward` runs it pipelined on the mesh."""
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

    def describe(self, params: Any, x: Any) -> str:
        """The stage cut for this parameter tree and global batch, as text: each
        stage's calls, parameter bytes, estimated FLOPs and input shapes, shared
        (tied) parameters, and the imbalance (cutting warns above 1.5x)."""
        return self.cut(params, x).describe()

    def _step(
        self,
        params: Any,
        x: Any,
        y: Any,
        loss_fn: LossFn,
        has_aux: bool = False,
        rngs: dict[str, jax.Array] | None = None,
    ) -> tuple[StageCut, Any]:
        with _explain_rng_errors():
            return self._lowered_step(params, x, y, loss_fn, has_aux, rngs)

    def _keyed_cut(self, params: Any, x: Any, rngs: dict[str, jax.Array] | None) -> StageCut:
        """`cut`; the cut traces the model, so a model with rngs gets stand-in keys."""
        from pjit_pipe.lowering.rng import check_rngs, impls_of, microbatch_rngs

        if rngs is None:
            return self.cut(params, x)
        example = {k: jax.random.key_data(v) for k, v in check_rngs(rngs).items()}
        with microbatch_rngs(example, impls_of(check_rngs(rngs))):
            return self.cut(params, x)

    def _lowered_step(self, params, x, y, loss_fn, has_aux, rngs):
        from pjit_pipe.lowering import lower  # the compiler is heavy; load it on first use

        self._batch(x, y)
        if self.measure and self.measured_costs is None:
            self.measured_costs = self.measure_costs(params, x, y, loss_fn)
            self._make_schedule(self.measured_costs)
        cut = self._keyed_cut(params, x, rngs)
        avals = jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), (x, y))
        key = (id(cut), loss_fn, has_aux, tuple(sorted(rngs or ())), str(avals))
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
                has_aux=has_aux,
                rngs=rngs,
                shared=cut.shared,
                async_weights=self.async_weights,
            )
        return cut, self._steps[key]

    # ---- training ----

    def value_and_grad(
        self, loss_fn: LossFn, has_aux: bool = False
    ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
        """f(params, x, y) -> (loss over the global batch, grads shaped like params).

        loss_fn(outputs, y_mb) returns the mean loss of one microbatch (the loss is
        then the mean over the global batch), or a pair (loss_sum, weight) (the
        loss is then sum(loss_sum) / sum(weight) over the global batch: masked
        and weighted losses). With has_aux=True it returns (loss, aux), aux a
        pytree of arrays, and f returns ((loss, aux), grads) with each aux leaf
        averaged over the D*m microbatches (as float32).

        f(..., rngs=key or {stream: key}) runs a model that draws random numbers
        (dropout): microbatch i of the global batch uses fold_in(key, i) (see rngs.py).
        """

        def value_and_grad(params: Any, x: Any, y: Any, rngs: Any = None) -> tuple[Any, Any]:
            rngs = step_rngs(rngs)
            cut, step = self._step(params, x, y, loss_fn, has_aux, rngs)
            params = self.place(params)
            loss, grads = step.value_and_grad(cut.split(params), x, y, rngs)
            return loss, cut.merge(grads)

        return value_and_grad

    def forward(self, params: Any, x: Any, rngs: Any = None) -> Any:
        """The model's outputs for the global batch x, computed by the pipeline on the
        mesh (the schedule's forwards only; float outputs come back in x's row order,
        floating leaves as their dtype). `rngs` as in `value_and_grad`. For other
        batch sizes (sampling one sequence) use the unpipelined `apply`."""
        from pjit_pipe.lowering.forward import lower_forward

        rngs = step_rngs(rngs)
        self._batch(x, x)
        with _explain_rng_errors():
            cut = self._keyed_cut(params, x, rngs)
            avals = jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), x)
            key = (id(cut), "forward", tuple(sorted(rngs or ())), str(avals))
            if key not in self._steps:
                self._steps[key] = lower_forward(
                    self.schedule, cut.stage_fns(), self.mesh, cut.split(params), x, rngs
                )
        return self._steps[key].forward(cut.split(self.place(params)), x, rngs)

    def place(self, tree: Any) -> Any:
        """`tree` replicated on the devices this pipeline runs on (a no-op when it is):
        the batch of a step, and value_and_grad's parameters."""
        return jax.device_put(tree, NamedSharding(self.device_mesh, PartitionSpec()))

    def train_step(self, loss_fn: LossFn, donate: bool = True) -> TrainStep:
        """A training step for `loss_fn` with the pipeline's optax optimizer; with
        `donate` each step consumes the state it is given (its memory is reused)."""
        if self.optimizer is None:
            raise ValueError("train_step: pipeline(..., optimizer=...) needs an optax optimizer")
        return TrainStep(self, loss_fn, donate)


@contextlib.contextmanager
def _explain_rng_errors() -> Iterator[None]:
    """linen's InvalidRngError (a model that draws random numbers, run without keys)
    as an error that says which argument to pass."""
    try:
        yield
    except flax.errors.InvalidRngError as e:
        raise ValueError(
            f"rngs: the model draws random numbers ({e}); pass rngs=jax.random.key(...) "
            "(the 'dropout' stream) or a dict {stream: key} to the step, or make the "
            "model deterministic"
        ) from e


class TrainStep:
    """step(state, (x, y)) -> (new state, loss before the update); step.init(params, batch).

    The state stays in this pipeline's device layout between steps (see
    frontend/state.py): the compiled step takes and returns each device's own
    rows, donated unless `donate` is False. A state from another pipeline
    (another mesh, a failure variant) is moved into this layout first.
    """

    def __init__(self, pipelined: Pipelined, loss_fn: LossFn, donate: bool = True):
        self.pipelined = pipelined
        self.loss_fn = loss_fn
        self.donate = donate

    def _program(
        self, params: Any, batch: tuple[Any, Any], rngs: Any = None
    ) -> tuple[Any, StateView]:
        """The compiled pipeline for these shapes (and rng streams) and its state view."""
        cut, step = self.pipelined._step(params, *batch, self.loss_fn, rngs=rngs)
        views = self.pipelined._views
        if id(step) not in views:
            views[id(step)] = StateView(cut, step.layout, self.pipelined.optimizer)
        return step, views[id(step)]

    def view(self, params: Any, batch: tuple[Any, Any]) -> StateView:
        """The state view (module layout <-> this step's device layout) for parameters
        shaped like `params` (arrays or ShapeDtypeStructs) and batches like `batch`."""
        model = self.pipelined.model
        return self._program(model.variables(model.params(params)), batch)[1]

    def init(
        self,
        params: Any,
        batch: tuple[Any, Any],
        opt_state: Any = None,
        step: int = 0,
        rngs: Any = None,
    ) -> TrainState:
        """A TrainState from module-layout `params` (and `opt_state`, default a fresh
        `optimizer.init`; `step`, e.g. from a checkpoint); `batch` is an example
        (x, y) that fixes the stage cut, and `rngs` an example key for a model that
        draws random numbers. Each stage's rows are built on its devices."""
        model = self.pipelined.model
        params = model.variables(model.params(params))  # e.g. an nnx.State -> its pure dict
        _, view = self._program(params, batch, step_rngs(rngs))
        check_opt_layout(view.cut, self.pipelined.optimizer, params)
        device_params, device_opt = view.to_device(params, opt_state)
        return TrainState(device_params, device_opt, step, view)

    def adopt(
        self, state: TrainState, batch: tuple[Any, Any], unavailable: Collection[Any] = ()
    ) -> tuple[TrainState, int]:
        """`state` in this step's device layout, and the bytes that moved to get it
        there. Devices that run the same stages keep their rows; a device new to
        its stages copies them from a live peer; `unavailable` devices (failed
        ones) are never read."""
        _, view = self._program(state.view.variables, batch)
        return self._into(view, state, unavailable)

    @staticmethod
    def _into(
        view: StateView, state: TrainState, unavailable: Collection[Any] = ()
    ) -> tuple[TrainState, int]:
        if state.view is view:
            return state, 0
        try:
            params, opt, moved = view.layout.relayout(
                state.view.layout, state.device_params, state.device_opt, unavailable
            )
        except ValueError:  # another stage cut or chunk layout: via the module layout
            params, opt = state.view.to_module(state, unavailable)
            params, opt = view.to_device(params, opt)
            moved = sum(b.nbytes for b in jax.tree.leaves((params, opt)))  # at most this
        return TrainState(params, opt, state.step, view), moved

    def __call__(
        self, state: TrainState, batch: tuple[Any, Any], rngs: Any = None
    ) -> tuple[TrainState, jax.Array]:
        """One step; `rngs` (a key or {stream: key}) for a model that draws random
        numbers, as in `Pipelined.value_and_grad`."""
        rngs = step_rngs(rngs)
        step, view = self._program(state.view.variables, batch, rngs)
        state, _ = self._into(view, state)
        x, y = self.pipelined.place(batch)
        params, opt, loss = step.device_train_step(
            state.device_params, state.device_opt, x, y, self.donate, rngs
        )
        return TrainState(params, opt, state.step + 1, view), loss

    def compile(self, state: TrainState, batch: tuple[Any, Any]) -> float:
        """Compile ahead of time for states like this one and batches shaped like
        `batch` (arrays or ShapeDtypeStructs); returns the seconds it took."""
        step, _ = self._program(state.view.variables, batch)
        sharding = NamedSharding(self.pipelined.device_mesh, PartitionSpec())
        x, y = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=sharding),
            batch,
        )
        return step.compile_device_train_step(x, y, self.donate)


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
    the re-routed schedule search), async_weights (schedule='async-1f1b' only:
    'predict' (default), 'stash' or 'latest', the weights its stale forwards read).
    """
    if module is None:
        return lambda m: pipeline(m, **options)
    if isinstance(module, type) and issubclass(module, nn.Module | nnx.Module):
        return PipelinedClass(module, options)
    if isinstance(module, list | tuple):
        nnx_layers = any(isinstance(m, nnx.Module) for m in module)
        module = nnx.Sequential(*module) if nnx_layers else nn.Sequential(list(module))
    return Pipelined(module, **options)
