"""`Pipelined`: a Flax module run as a pipeline, with the module's own API.

The user keeps plain Flax parameters (`module.init` for linen, the module's
nnx.Param state for NNX; see `adapters.py`); the pipelined object
cuts the model into stages on first use (per input shape), splits parameters
per stage for the lowering and merges gradients back, so everything the user
sees or checkpoints has the module's own tree structure.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pjit_pipe.compiler import (
    ScheduleSpec,
    build_program,
    build_schedule,
    build_table,
    chunks_of,
    layout_of,
)
from pjit_pipe.errors import BatchError, OptimizerError, OptionError
from pjit_pipe.frontend.cutter.adapters import as_model
from pjit_pipe.frontend.cutter.cut import StageCut, cut_module
from pjit_pipe.frontend.cutter.tensor_split import rebox, stage_splits, unbox
from pjit_pipe.frontend.inputs import explained_rng_errors, leading_dim
from pjit_pipe.frontend.mesh import make_mesh, pipeline_mesh, tensor_size
from pjit_pipe.frontend.opt_state import check_opt_layout
from pjit_pipe.frontend.options import PipelineOptions
from pjit_pipe.frontend.program_cache import ProgramCache, ProgramKey
from pjit_pipe.frontend.rngs import step_rngs, with_step_rngs
from pjit_pipe.frontend.state import StateView
from pjit_pipe.frontend.train_step import TrainStep
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, Topology, check_loss_fn

if TYPE_CHECKING:
    from pjit_pipe.lowering import PipelineStep

LossFn = Callable[[Any, Any], jax.Array]


class Pipelined:
    """A Flax module run as a pipeline under `options` (see `PipelineOptions`).

    `cuts` shares the stage-cut cache of another pipeline of the same module
    with the same stage count and balance (its failure variants): cutting
    traces the model, so a variant need not do it again.
    """

    def __init__(
        self,
        module: nn.Module | nnx.Module,
        options: PipelineOptions,
        *,
        cuts: dict[Any, StageCut] | None = None,
    ):
        self.module = module
        self.options = options
        self.model = with_step_rngs(as_model(module))
        self.stages = options.stages
        self.microbatches = options.microbatches
        self.mesh: Mesh = (
            make_mesh(data=1, stage=self.stages) if options.mesh is None else options.mesh
        )
        self.replicas = options.replicas
        self.failed = FailurePattern.of(self.replicas, self.stages, options.failed)
        self.spec = ScheduleSpec(
            options.schedule,
            self.stages,
            self.microbatches,
            options.chunks,
            self.replicas,
            self.failed,
            options.mem_limit,
            search_time=options.search_time,
        )
        self.chunks = chunks_of(options.schedule, options.chunks)
        # The costs the schedule is built and its ticks packed with, resolved once:
        # the ones given, or with costs="measure" (auto's default) the ones measured
        # from the model at first use; the schedule waits for them.
        costs = options.costs
        if costs is None and options.schedule == "auto":
            costs = "measure"
        self.measure = costs == "measure"
        self.costs: Costs | None = None if self.measure else costs
        self.stage_times = None  # measure.StageTimes, once measured
        self._schedule: Schedule | None = None
        if not self.measure:
            self.schedule  # noqa: B018  (built now: a request no schedule meets fails here)
        # The mesh the compiled program runs on: `mesh`, or the survivors' devices.
        self.device_mesh: Mesh = Topology.of(self.mesh, self.failed.failed).mesh
        self.optimizer = options.optimizer
        self.remat = options.remat
        self.balance = options.balance
        self.cuts: dict[Any, StageCut] = {} if cuts is None else cuts  # per (x, params) shapes
        self._programs: ProgramCache[Any] = ProgramCache(options.max_programs)
        # Per compiled program: its state view (module layout <-> device layout).
        self._views: weakref.WeakKeyDictionary[Any, StateView] = weakref.WeakKeyDictionary()

    @property
    def schedule(self) -> Schedule:
        """The schedule this pipeline runs, built once (`compiler.build_schedule`) under
        its resolved costs. With costs="measure" those are measured from the model
        first: run a step, or `measure_schedule(params, x, y, loss_fn)`, before asking."""
        if self._schedule is None:
            if self.measure and self.costs is None:
                raise OptionError(
                    "schedule: with costs='measure' (auto's default) the schedule is made "
                    "under costs measured from the model; call pm.measure_schedule(params, "
                    "x, y, loss_fn) or run a step first, or pass costs=pp.Costs(...)"
                )
            self._schedule = build_schedule(self.spec, self.costs)
        return self._schedule

    def measure_costs(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> Costs:
        """Per-stage F/B/W (ms) measured on this pipeline's devices for these shapes
        (cached per model, loss, shapes and devices; see `measure.py`)."""
        from pjit_pipe.frontend.planning.measure import measure_stage_times

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
            cut.stage_fns(), loss_fn, stage_params, x_mb, y_mb, pipeline_mesh(self.mesh), key=key
        )
        self.stage_times = times
        return times.costs(self.stages, layout_of(self.spec.kind, self.stages, self.chunks))

    def measure_schedule(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> None:
        """With costs="measure": measure the stage costs (once), which the schedule is
        then built under; `schedule`, `tick_table()` and `costs` then tell what the
        program will run."""
        if self.measure and self.costs is None:
            self.costs = self.measure_costs(params, x, y, loss_fn)

    def with_options(self, **changes: Any) -> Pipelined:
        """A copy with some options changed (e.g. another mesh or optimizer), as
        `dataclasses.replace` on `options`: the changes are checked the same way."""
        known = {f.name for f in dataclasses.fields(PipelineOptions)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise OptionError(
                f"with_options: unknown option {unknown[0]!r}; the options are "
                f"{', '.join(sorted(known))} (see PipelineOptions)"
            )
        return Pipelined(self.module, dataclasses.replace(self.options, **changes))

    def with_failures(self, failed: Sequence[tuple[int, int]]) -> Pipelined:
        """The same model and API on the surviving devices: `failed` lists the
        (replica, stage) workers that are down (an empty list: the fault-free
        pipeline). Their microbatches run on peers of the same stage, so the
        loss and gradients are those of the fault-free step on the same batch.

        Raises FailurePlanError for anything but a list of (replica, stage)
        pairs, and naming the stage when a stage has no survivor.
        """
        # A re-routed program steps the optimizer inside its loop, which ZeRO does
        # not: while workers are down the survivors hold their stages' whole optax
        # state (joined from the slices and their copies; lowering/layout/zero.py).
        zero = self.options.zero and not failed
        options = dataclasses.replace(self.options, failed=failed, zero=zero)
        return Pipelined(self.module, options, cuts=self.cuts)  # same module and stages

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
        batch = leading_dim("x", x)
        if leading_dim("y", y) != batch:
            raise BatchError(f"y: batch size {leading_dim('y', y)} differs from x's {batch}")
        if batch % n:
            raise BatchError(
                f"x: global batch {batch} is not divisible by data*microbatches = "
                f"{self.replicas}*{self.microbatches} = {n}; use a multiple of {n}"
            )
        return batch // n

    def cut(self, params: Any, x: Any) -> StageCut:
        """The stage cut for this parameter tree and global batch `x` (cached)."""
        mb = leading_dim("x", x) // (self.replicas * self.microbatches)
        x_mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((mb, *np.shape(a)[1:]), a.dtype), x)
        leaves, treedef = jax.tree.flatten(self.model.params(params))
        key = (jax.tree.structure(x_mb), tuple(jax.tree.leaves(x_mb)), treedef)
        key += tuple((np.shape(a), jnp.result_type(a)) for a in leaves)
        if key not in self.cuts:
            self.cuts[key] = cut_module(
                self.model,
                params,
                x_mb,
                self.stages * self.chunks,
                self.balance,
                self.options.layers,
            )
        return self.cuts[key]

    def describe(self, params: Any, x: Any) -> str:
        """The stage cut for this parameter tree and global batch, as text: each
        stage's calls, parameter bytes, estimated FLOPs and input shapes, shared
        (tied) parameters, and the imbalance (cutting warns above 1.5x)."""
        return self.cut(params, x).describe()

    def program(
        self,
        params: Any,
        x: Any,
        y: Any,
        loss_fn: LossFn,
        has_aux: bool = False,
        rngs: dict[str, jax.Array] | None = None,
        boxed: Any = None,
    ) -> tuple[StageCut, PipelineStep]:
        """The stage cut and the compiled pipeline program (`lowering.PipelineStep`) for
        `loss_fn` and these shapes, from the cache of the last `max_programs` ones.
        `params` are plain; `boxed` (tensor_split.unbox) says how weights split."""
        with explained_rng_errors():
            return self._program(params, x, y, loss_fn, has_aux, rngs, boxed)

    def leaf_splits(self, cut: StageCut, params: Any, boxed: Any) -> list[list] | None:
        """Per stage, per parameter leaf, its split over 'tensor' (tensor_split.py)."""
        names = getattr(self.model, "sharding_names", lambda: None)()
        return stage_splits(cut, params, boxed, tensor_size(self.mesh), names)

    def state_view(self, cut: StageCut, program: PipelineStep, boxed: Any = None) -> StateView:
        """The state view of `program` (module layout <-> its device layout), one per
        program; `boxed`: the annotated params whose boxes `state.params` comes back in."""
        if program not in self._views:
            self._views[program] = StateView(cut, program.layout, self.optimizer, boxed)
        return self._views[program]

    def _keyed_cut(self, params: Any, x: Any, rngs: dict[str, jax.Array] | None) -> StageCut:
        """`cut`; the cut traces the model, so a model with rngs gets stand-in keys."""
        from pjit_pipe.lowering import check_rngs, impls_of, microbatch_rngs

        if rngs is None:
            return self.cut(params, x)
        example = {k: jax.random.key_data(v) for k, v in check_rngs(rngs).items()}
        with microbatch_rngs(example, impls_of(check_rngs(rngs))):
            return self.cut(params, x)

    def tick_table(self) -> PackedTicks:
        """The tick table the compiled program runs: the schedule's ops packed by
        their costs (an asynchronous schedule is not packed: one op per tick), for
        the price of `PipelineOptions.resolved_tick_sync()`. Cached by pack_ticks."""
        return build_table(
            self.schedule,
            self.costs,
            1,
            self.options.mem_limit,
            self.options.pack_polish,
            sync=self.options.resolved_tick_sync(),
        )

    def _program(
        self, params, x, y, loss_fn, has_aux, rngs, boxed
    ) -> tuple[StageCut, PipelineStep]:
        self._batch(x, y)
        self.measure_schedule(params, x, y, loss_fn)
        cut = self._keyed_cut(params, x, rngs)
        avals = jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), (x, y))
        splits = self.leaf_splits(cut, params, boxed)
        key = ProgramKey(
            loss_fn, (id(cut), has_aux, tuple(sorted(rngs or ())), str(avals), str(splits))
        )

        def build() -> PipelineStep:
            if self.optimizer is not None:
                check_opt_layout(cut, self.optimizer, params)  # before optax meets a stage
            return build_program(
                self.tick_table(),
                cut.stage_fns(),
                loss_fn,
                self.mesh,
                cut.split(params),
                x,
                y,
                LoweringOptions(
                    optimizer=self.optimizer,
                    remat=self.remat,
                    has_aux=has_aux,
                    rngs=rngs,
                    shared=cut.shared,
                    async_weights=self.options.async_weights,
                    pairwise=self.options.resolved_tick_sync() == "neighbor",
                    zero=self.options.zero,
                    splits=splits,
                ),
            )

        return cut, self._programs.get(key, build)

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

        check_loss_fn(loss_fn)

        def value_and_grad(params: Any, x: Any, y: Any, rngs: Any = None) -> tuple[Any, Any]:
            rngs = step_rngs(rngs)
            params, boxed = unbox(params)
            cut, step = self.program(params, x, y, loss_fn, has_aux, rngs, boxed)
            params = self.place(params)
            loss, grads = step.value_and_grad(cut.split(params), x, y, rngs)
            return loss, rebox(cut.merge(grads), boxed)

        return value_and_grad

    def forward(self, params: Any, x: Any, rngs: Any = None) -> Any:
        """The model's outputs for the global batch x, computed by the pipeline on the
        mesh (the schedule's forwards only; float outputs come back in x's row order,
        floating leaves as their dtype). `rngs` as in `value_and_grad`. For other
        batch sizes (sampling one sequence) use the unpipelined `apply`."""
        from pjit_pipe.lowering import lower_forward

        rngs = step_rngs(rngs)
        self._batch(x, x)
        params, boxed = unbox(params)
        with explained_rng_errors():
            cut = self._keyed_cut(params, x, rngs)
            splits = self.leaf_splits(cut, params, boxed)
            avals = jax.tree.map(lambda a: (np.shape(a), jnp.result_type(a)), x)
            key = ProgramKey(
                "forward", (id(cut), tuple(sorted(rngs or ())), str(avals), str(splits))
            )
            program = self._programs.get(
                key,
                lambda: lower_forward(
                    self.schedule, cut.stage_fns(), self.mesh, cut.split(params), x, rngs, splits
                ),
            )
        return program.forward(cut.split(self.place(params)), x, rngs)

    def place(self, tree: Any) -> Any:
        """`tree` replicated on the devices this pipeline runs on (a no-op when it is):
        the batch of a step, and value_and_grad's parameters."""
        return jax.device_put(tree, NamedSharding(self.device_mesh, PartitionSpec()))

    def train_step(self, loss_fn: LossFn, donate: bool = True, carry: bool = False) -> TrainStep:
        """A training step for `loss_fn` with the pipeline's optax optimizer; with
        `donate` each step consumes the state it is given (its memory is reused);
        with `carry` (async-1f1b) steps do not drain the pipeline (see TrainStep)."""
        if self.optimizer is None:
            raise OptimizerError(
                "train_step needs an optax optimizer: pass pipeline(..., "
                "optimizer=optax.adam(1e-3)) (any optax transformation)"
            )
        check_loss_fn(loss_fn)
        return TrainStep(self, loss_fn, donate, carry)
