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
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pjit_pipe.compiler import (
    ScheduleSpec,
    build_schedule,
    chunks_of,
)
from pjit_pipe.errors import OptimizerError, OptionError
from pjit_pipe.frontend.compiled_programs import CompiledPrograms
from pjit_pipe.frontend.cutter.adapters import as_model
from pjit_pipe.frontend.cutter.cut import StageCut
from pjit_pipe.frontend.cutter.tensor_split import rebox, unbox
from pjit_pipe.frontend.inputs import explained_rng_errors
from pjit_pipe.frontend.mesh import make_mesh
from pjit_pipe.frontend.options import PipelineOptions
from pjit_pipe.frontend.program_cache import ProgramCache, ProgramKey
from pjit_pipe.frontend.rngs import step_rngs, with_step_rngs
from pjit_pipe.frontend.state import StateView
from pjit_pipe.frontend.train_step import TrainStep
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering import Topology, check_loss_fn

if TYPE_CHECKING:
    pass

LossFn = Callable[[Any, Any], jax.Array]


class Pipelined(CompiledPrograms):
    """A Flax module run as a pipeline under `options` (see `PipelineOptions`).

    `cuts` shares the stage-cut cache of another pipeline of the same module
    with the same stage count and balance (its failure variants): cutting
    traces the model, so a variant need not do it again. `schedule` and
    `tick_table()` tell what the program will run; `measure_schedule` first
    with costs="measure". `apply` is the unpipelined forward pass, for
    evaluation and sampling at any batch size; `forward` runs it pipelined.

    Args:
        module: the Flax module (linen or NNX).
        options: how it is pipelined (checked when made).
        cuts: the stage-cut cache to share (per (x, params) shapes).

    Raises:
        OptionError: no schedule meets the request (with given costs).
        FailurePlanError: `options.failed` leaves a stage without a survivor.
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
            slow=dict(options.slow),
            # Re-routed, every stage still steps after the iteration's last op, as in
            # the fault-free program: a global-norm clip and tied weights need every
            # stage's gradients before any stage steps.
            stagger_reroutes=False,
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
        # With remat="auto": per virtual stage, residual_choice.PolicyChoice (the
        # residual policy chosen and every candidate's measured time and bytes),
        # once the first program is built.
        self.stage_policies: tuple[Any, ...] | None = None
        self.balance = options.balance
        self.cuts: dict[Any, StageCut] = {} if cuts is None else cuts  # per (x, params) shapes
        self._programs: ProgramCache[Any] = ProgramCache(options.max_programs)
        # Per compiled program: its state view (module layout <-> device layout).
        self._views: weakref.WeakKeyDictionary[Any, StateView] = weakref.WeakKeyDictionary()

    @property
    def schedule(self) -> Schedule:
        """The schedule this pipeline runs, built once (`compiler.build_schedule`).

        Returns:
            The schedule under the resolved costs.

        Raises:
            OptionError: costs="measure" before they are measured: run a step, or
                `measure_schedule(params, x, y, loss_fn)`, before asking.
        """
        if self._schedule is None:
            if self.measure and self.costs is None:
                raise OptionError(
                    "schedule: with costs='measure' (auto's default) the schedule is made "
                    "under costs measured from the model; call pm.measure_schedule(params, "
                    "x, y, loss_fn) or run a step first, or pass costs=pp.Costs(...)"
                )
            self._schedule = build_schedule(self.spec, self.costs)
        return self._schedule

    def with_options(self, **changes: Any) -> Pipelined:
        """A copy with some options changed, as `dataclasses.replace` on `options`.

        Args:
            **changes: PipelineOptions fields and their new values (e.g. mesh).

        Returns:
            The new Pipelined, its options checked as when made.

        Raises:
            OptionError: an unknown option, or a value PipelineOptions refuses.
        """
        known = {f.name for f in dataclasses.fields(PipelineOptions)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise OptionError(
                f"with_options: unknown option {unknown[0]!r}; the options are "
                f"{', '.join(sorted(known))} (see PipelineOptions)"
            )
        return Pipelined(self.module, dataclasses.replace(self.options, **changes))

    def with_failures(self, failed: Sequence[tuple[int, int]]) -> Pipelined:
        """The same model and API on the surviving devices.

        The down workers' microbatches run on peers of the same stage, so the loss
        and gradients are those of the fault-free step on the same batch.

        Args:
            failed: the (replica, stage) workers that are down (an empty list: the
                fault-free pipeline).

        Returns:
            The Pipelined of the survivors, sharing this one's stage cuts.

        Raises:
            FailurePlanError: anything but a list of (replica, stage) pairs, or
                (naming it) a stage with no survivor.
        """
        # The survivors' mesh has no 'data' axis for ZeRO's reduce-scatter (a stage's
        # live replicas sum down a ppermute chain): while workers are down they hold
        # their stages' whole optax state (joined from the slices and their copies;
        # lowering/layout/zero.py).
        options = self.options.with_zero(0 if failed else self.options.zero, failed=failed)
        return Pipelined(self.module, options, cuts=self.cuts)  # same module and stages

    def with_slow(self, slow: Mapping[tuple[int, int], float]) -> Pipelined:
        """The same model and API with part of the slow workers' work moved to peers.

        Each op of worker (replica, stage) is taken to last `factor` times as
        long; the schedule moves part of its microbatches to peers of its stage
        (`make_schedule(..., slow=)`). The loss and gradients are those of the
        fault-free step on the same batch.

        Args:
            slow: {(replica, stage): factor >= 1} ({}: every worker at full speed).

        Returns:
            The Pipelined for those speeds, sharing this one's stage cuts.

        Raises:
            FailurePlanError: a worker outside the mesh or failed, or a factor
                that is not a finite number >= 1.
        """
        # The mitigated program steps the optimizer inside its loop, which ZeRO does not.
        slowed = any(f > 1 for f in dict(slow).values())
        options = self.options.with_zero(0 if slowed else self.options.zero, slow=slow)
        return Pipelined(self.module, options, cuts=self.cuts)

    # ---- the plain module API ----

    def init(self, rng: jax.Array, x: Any) -> Any:
        """The module's parameters.

        Args:
            rng: the key (linen).
            x: an example input batch.

        Returns:
            linen: `module.init(rng, x)`, plain Flax variables. NNX: the module's own
            nnx.Param state as a pure dict (an NNX module is initialized when built).
        """
        return self.model.init(rng, x)

    def apply(self, params: Any, x: Any) -> Any:
        """The unpipelined forward pass (`module.apply`).

        Args:
            params: the module's parameters.
            x: a batch of any size.

        Returns:
            The model's outputs.
        """
        return self.model.apply(params, x)

    # ---- training ----

    def value_and_grad(
        self, loss_fn: LossFn, has_aux: bool = False
    ) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
        """f(params, x, y) -> (loss over the global batch, grads shaped like params).

        f(..., rngs=key or {stream: key}) runs a model that draws random numbers
        (dropout): microbatch i of the global batch uses fold_in(key, i) (see rngs.py).

        Args:
            loss_fn: loss_fn(outputs, y_mb) returns the mean loss of one microbatch
                (the loss is then the mean over the global batch), or a pair
                (loss_sum, weight) (the loss is then sum(loss_sum) / sum(weight)
                over the global batch: masked and weighted losses).
            has_aux: loss_fn returns (loss, aux), aux a pytree of arrays, and f
                ((loss, aux), grads), each aux leaf averaged over the D*m
                microbatches (as float32).

        Returns:
            f, which raises BatchError and RngError as `program` does.

        Raises:
            LossFnError: `loss_fn` is not a function of (outputs, y).
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
        """The pipelined forward pass (the schedule's forwards only) on the mesh.

        Args:
            params: the module's parameters.
            x: the global batch; for other batch sizes (sampling one sequence) use
                the unpipelined `apply`.
            rngs: as in `value_and_grad`.

        Returns:
            The model's outputs in x's row order, floating leaves as their dtype.

        Raises:
            BatchError: x's batch is not divisible by data*microbatches.
            RngError: the model draws random numbers without `rngs`.
        """
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
        """Replicate on the devices this pipeline runs on (a no-op when it is).

        Args:
            tree: the batch of a step, or value_and_grad's parameters.

        Returns:
            `tree` replicated on `device_mesh`.
        """
        return jax.device_put(tree, NamedSharding(self.device_mesh, PartitionSpec()))

    def train_step(self, loss_fn: LossFn, donate: bool = True, carry: bool = False) -> TrainStep:
        """A training step for `loss_fn` with the pipeline's optax optimizer.

        Args:
            loss_fn: as in `value_and_grad`.
            donate: each step consumes the state it is given (its memory is reused).
            carry: (async-1f1b) steps do not drain the pipeline (see TrainStep).

        Returns:
            The TrainStep.

        Raises:
            OptimizerError: the pipeline has no optax optimizer.
            LossFnError: `loss_fn` is not a function of (outputs, y).
            OptionError: `carry` on a synchronous schedule or with failed workers.
        """
        if self.optimizer is None:
            raise OptimizerError(
                "train_step needs an optax optimizer: pass pipeline(..., "
                "optimizer=optax.adam(1e-3)) (any optax transformation)"
            )
        check_loss_fn(loss_fn)
        return TrainStep(self, loss_fn, donate, carry)
