"""How a `Pipelined` model gets its compiled programs: the stage cut, measured
costs, the tick table and the program, built through the one compile path
(`pjit_pipe.compiler`) and cached per loss function and shapes.

`CompiledPrograms` is a base of `Pipelined` (pipelined.py), which holds the
attributes it reads: the options, the schedule spec and the caches. Its own base
`MemoryReports` (memory_report.py) prices a pipeline's memory from shapes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjit_pipe.compiler import (
    ScheduleSpec,
    build_program,
    build_table,
    layout_of,
)
from pjit_pipe.errors import BatchError
from pjit_pipe.frontend.cutter.cut import StageCut, cut_module
from pjit_pipe.frontend.cutter.tensor_split import stage_splits
from pjit_pipe.frontend.inputs import explained_rng_errors, leading_dim
from pjit_pipe.frontend.memory_report import MemoryReports
from pjit_pipe.frontend.mesh import pipeline_mesh, tensor_size
from pjit_pipe.frontend.opt_state import check_opt_layout
from pjit_pipe.frontend.options import PipelineOptions
from pjit_pipe.frontend.program_cache import ProgramCache, ProgramKey
from pjit_pipe.frontend.state import StateView
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.memory import split_stages
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions

if TYPE_CHECKING:
    from pjit_pipe.frontend.pipelined import LossFn
    from pjit_pipe.lowering import PipelineStep


class CompiledPrograms(MemoryReports):
    """The program-building half of `Pipelined`: cut, measure, pack, compile."""

    module: Any
    model: Any
    options: PipelineOptions
    spec: ScheduleSpec
    schedule: Schedule
    stages: int
    chunks: int
    replicas: int
    microbatches: int
    mesh: Mesh
    measure: bool
    costs: Costs | None
    stage_times: Any
    optimizer: Any
    remat: bool | str
    stage_policies: tuple[Any, ...] | None
    balance: Any
    cuts: dict[Any, StageCut]
    _programs: ProgramCache[Any]
    _views: weakref.WeakKeyDictionary[Any, StateView]

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

    def measure_costs(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> Costs:
        """Per-stage F/B/W (ms) measured on this pipeline's devices (see `measure.py`).

        Args:
            params: the module's parameters.
            x: a global batch of inputs.
            y: its targets.
            loss_fn: as in `value_and_grad`.

        Returns:
            The Costs, cached per model, loss, shapes and devices.
        """
        from pjit_pipe.frontend.planning.measure import measure_stage_times

        cut, stage_params, x_mb, y_mb, key = self._microbatch_shapes(params, x, y, loss_fn)
        times = measure_stage_times(
            cut.stage_fns(), loss_fn, stage_params, x_mb, y_mb, pipeline_mesh(self.mesh), key=key
        )
        self.stage_times = times
        return times.costs(self.stages, layout_of(self.spec.kind, self.stages, self.chunks))

    def _microbatch_shapes(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> tuple:
        """(cut, stage params, microbatch x and y shapes, cache key: model, loss, shapes)
        for the measurements, which time one microbatch's ops."""
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
        return cut, stage_params, x_mb, y_mb, key

    def measure_schedule(self, params: Any, x: Any, y: Any, loss_fn: LossFn) -> None:
        """With costs="measure": measure the stage costs (once) to build the schedule under.

        Args:
            params: the module's parameters.
            x: a global batch of inputs.
            y: its targets.
            loss_fn: as in `value_and_grad`.
        """
        if self.measure and self.costs is None:
            self.costs = self.measure_costs(params, x, y, loss_fn)

    def residual_policies(
        self,
        params: Any,
        x: Any,
        y: Any,
        loss_fn: LossFn,
        rngs: dict[str, jax.Array] | None = None,
    ) -> tuple[str, ...] | None:
        """With remat="auto": each virtual stage's residual policy, the fastest measured
        within the default policy's pool rows (`residual_choice.py`); the figures go
        to `stage_policies`.

        Args:
            params: the module's parameters.
            x: a global batch of inputs.
            y: its targets.
            loss_fn: as in `value_and_grad`.
            rngs: {stream: key} for a model that draws random numbers: its
                stages are traced and timed with keys of these streams.

        Returns:
            One policy name per virtual stage (measured once per model, loss and
            shapes); None unless remat="auto".
        """
        if self.remat != "auto":
            return None
        from pjit_pipe.frontend.planning.residual_choice import choose_stage_policies

        split = split_stages(self.schedule)
        with self._rng_context(rngs):
            cut, stage_params, x_mb, y_mb, key = self._microbatch_shapes(params, x, y, loss_fn)
            choices = choose_stage_policies(
                cut.stage_fns(),
                loss_fn,
                stage_params,
                x_mb,
                y_mb,
                pipeline_mesh(self.mesh),
                split,
                key,
            )
        self.stage_policies = choices
        return tuple(c.policy for c in choices)

    def cut(self, params: Any, x: Any) -> StageCut:
        """The stage cut for this parameter tree and global batch (cached).

        Args:
            params: the module's parameters.
            x: a global batch of inputs.

        Returns:
            The StageCut.
        """
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
                self.options.split_points,
            )
        return self.cuts[key]

    def describe(self, params: Any, x: Any) -> str:
        """The stage cut for this parameter tree and global batch, as text.

        Args:
            params: the module's parameters.
            x: a global batch of inputs.

        Returns:
            Each stage's calls, parameter bytes, estimated FLOPs and input shapes,
            shared (tied) parameters, and the imbalance (cutting warns above 1.5x).
        """
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
        """The compiled program for `loss_fn` and these shapes (cached: `max_programs`).

        Args:
            params: the plain (unboxed) parameters.
            x: a global batch of inputs.
            y: its targets.
            loss_fn: as in `value_and_grad`.
            has_aux: as in `value_and_grad`.
            rngs: {stream: key} for a model that draws random numbers.
            boxed: the annotated params (tensor_split.unbox): how weights split.

        Returns:
            The stage cut and the program (`lowering.PipelineStep`).

        Raises:
            BatchError: x and y differ in batch size, or it is not divisible by
                data*microbatches.
            RngError: the model draws random numbers without `rngs`.
            OptimizerError: the optimizer state does not split by stage.
        """
        with explained_rng_errors():
            return self._program(params, x, y, loss_fn, has_aux, rngs, boxed)

    def leaf_splits(self, cut: StageCut, params: Any, boxed: Any) -> list[list] | None:
        """The weights' splits over 'tensor' (tensor_split.py).

        Args:
            cut: the stage cut.
            params: the plain parameters.
            boxed: the annotated params.

        Returns:
            Per stage, per parameter leaf, its split; None when nothing splits.
        """
        names = getattr(self.model, "sharding_names", lambda: None)()
        return stage_splits(cut, params, boxed, tensor_size(self.mesh), names)

    def state_view(self, cut: StageCut, program: PipelineStep, boxed: Any = None) -> StateView:
        """The state view of `program` (module layout <-> its device layout), one each.

        Args:
            cut: the program's stage cut.
            program: the compiled program.
            boxed: the annotated params whose boxes `state.params` comes back in.

        Returns:
            The StateView.
        """
        if program not in self._views:
            self._views[program] = StateView(cut, program.layout, self.optimizer, boxed)
        return self._views[program]

    def _keyed_cut(self, params: Any, x: Any, rngs: dict[str, jax.Array] | None) -> StageCut:
        """`cut`; the cut traces the model, so a model with rngs gets stand-in keys."""
        with self._rng_context(rngs):
            return self.cut(params, x)

    @staticmethod
    def _rng_context(rngs: dict[str, jax.Array] | None) -> Any:
        """A context in which stages that draw random numbers trace: stand-in keys of
        `rngs`' streams (none needed without rngs)."""
        from pjit_pipe.lowering import check_rngs, impls_of, microbatch_rngs

        if rngs is None:
            return contextlib.nullcontext()
        example = {k: jax.random.key_data(v) for k, v in check_rngs(rngs).items()}
        return microbatch_rngs(example, impls_of(check_rngs(rngs)))

    def tick_table(self) -> PackedTicks:
        """The tick table the compiled program runs. Cached by pack_ticks.

        Returns:
            The schedule's ops packed by their costs (an asynchronous schedule is
            not packed: one op per tick) for `PipelineOptions.resolved_tick_sync()`.
        """
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
        policies = self.residual_policies(params, x, y, loss_fn, rngs)
        key = ProgramKey(
            loss_fn, (id(cut), has_aux, tuple(sorted(rngs or ())), str(avals), str(splits))
        )

        def build() -> PipelineStep:
            cut.check_loss(loss_fn, y)  # reads no output the last stage cannot compute
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
                    remat=self.remat is True,
                    policies=policies,
                    has_aux=has_aux,
                    rngs=rngs,
                    shared=cut.shared,
                    async_weights=self.options.async_weights,
                    pairwise=self.options.resolved_tick_sync() == "neighbor",
                    # One replica has nothing to shard the state over.
                    zero=self.options.zero if self.mesh.shape["data"] > 1 else 0,
                    grad_sum=self.options.grad_sum,
                    splits=splits,
                ),
            )

        return cut, self._programs.get(key, build)
