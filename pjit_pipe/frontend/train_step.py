"""`TrainStep`: one optimizer step of a pipelined model, its state kept in device layout."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pjit_pipe.errors import BatchError, OptionError, RngError, StateError
from pjit_pipe.frontend.cutter.tensor_split import unbox
from pjit_pipe.frontend.rngs import step_rngs
from pjit_pipe.frontend.skip_log import SkipLog
from pjit_pipe.frontend.state import StateView, TrainState

if TYPE_CHECKING:
    from pjit_pipe.frontend.pipelined import LossFn, Pipelined
    from pjit_pipe.lowering import PipelineStep


class TrainStep:
    """step(state, (x, y)) -> (new state, loss before the update); step.init(params, batch).

    The state stays in this pipeline's device layout between steps (see
    frontend/state.py): the compiled step takes and returns each device's own
    rows, donated unless `donate` is False. A state from another pipeline
    (another mesh, a failure variant) is moved into this layout first. A state
    a donating step consumed raises StateError; keep the returned one.

    A step whose loss or global gradient norm is not finite is skipped inside
    the compiled program (PipelineOptions.skip_nonfinite): the returned state
    holds the parameters and optimizer state it was given, its `skipped` count
    goes up and a RuntimeWarning names the step. The step does not wait for
    its flag: it is read when `state.skipped` is (which waits for the step),
    or else in the next step's call, once that step is dispatched (skip_log.py).

    With `carry` (async-1f1b only) a step does not drain the pipeline: the
    microbatches in flight at its end stay in `state.in_flight` and the next
    step goes on from them (lowering/async_pipeline/async_carry.py). Its loss is then the
    previous step's batch's (NaN at the first step), and `flush(state)`
    finishes the microbatches in flight: call it before reading exact
    parameters, saving a checkpoint or switching programs.
    """

    def __init__(
        self, pipelined: Pipelined, loss_fn: LossFn, donate: bool = True, carry: bool = False
    ):
        """Usually made by `Pipelined.train_step`, which checks the optimizer and loss.

        Args:
            pipelined: the pipeline whose programs and optax optimizer step.
            loss_fn: loss_fn(outputs, y_mb), as in `Pipelined.value_and_grad`.
            donate: whether each step consumes the state it is given.
            carry: async-1f1b only: steps do not drain the pipeline.

        Raises:
            OptionError: `carry` on a synchronous schedule or with failed workers.
        """
        self.pipelined = pipelined
        self.loss_fn = loss_fn
        self.donate = donate
        if carry:
            from pjit_pipe.lowering import check_carry  # the compiler: on first use

            check_carry(pipelined.schedule, rngs=False)
        self.carry = carry
        # The program of each state view this step has carried microbatches in (flush runs it).
        self._carried_by: dict[StateView, PipelineStep] = {}
        # The last call's (state view, batch signature, rng streams) and the program
        # and view it got: steps of one run ask for the same one, and finding it in
        # the pipeline's cache keys every parameter leaf's shape (`_state_program`).
        # The program stays alive while remembered, even if that cache drops it.
        self._last: tuple[StateView, tuple, tuple, tuple[Any, StateView]] | None = None

    def _program(
        self, params: Any, batch: tuple[Any, Any], rngs: Any = None, boxed: Any = None
    ) -> tuple[Any, StateView]:
        """The compiled pipeline for these shapes (and rng streams) and its state view;
        `boxed`: the annotated params that say how weights split over 'tensor'."""
        cut, step = self.pipelined.program(params, *batch, self.loss_fn, rngs=rngs, boxed=boxed)
        return step, self.pipelined.state_view(cut, step, boxed)

    def view(self, params: Any, batch: tuple[Any, Any]) -> StateView:
        """The state view (module layout <-> this step's device layout).

        Args:
            params: parameters shaped like the state's (arrays or
                ShapeDtypeStructs, boxed or not).
            batch: an (x, y) pair shaped like the batches to come.

        Returns:
            The StateView of the program for these shapes.

        Raises:
            BatchError: `batch` is not the pair (x, y), x and y differ in batch
                size, or it is not divisible by data*microbatches.
        """
        model = self.pipelined.model
        params, boxed = unbox(params)
        return self._program(model.variables(model.params(params)), batch, boxed=boxed)[1]

    def init(
        self,
        params: Any,
        batch: tuple[Any, Any],
        opt_state: Any = None,
        step: int = 0,
        rngs: Any = None,
        skipped: int = 0,
    ) -> TrainState:
        """A TrainState from module-layout parameters; each stage's rows are built on
        its devices.

        Args:
            params: the module-layout parameters (boxed or not).
            batch: an example (x, y) that fixes the stage cut.
            opt_state: the module-layout optax state; None: a fresh `optimizer.init`.
            step: the steps taken so far, e.g. from a checkpoint.
            rngs: an example key for a model that draws random numbers.
            skipped: the non-finite steps skipped so far.

        Returns:
            The state in this step's device layout.

        Raises:
            BatchError: `batch` is not the pair (x, y), x and y differ in batch
                size, or it is not divisible by data*microbatches.
            OptimizerError: the optimizer cannot be split over the stages.
        """
        model = self.pipelined.model
        params, boxed = unbox(params)  # annotated weights: how they split over 'tensor'
        params = model.variables(model.params(params))  # e.g. an nnx.State -> its pure dict
        _, view = self._program(params, batch, step_rngs(rngs), boxed)  # checks the optimizer
        device_params, device_opt = view.to_device(params, unbox(opt_state)[0])
        return TrainState(device_params, device_opt, step, view, skip_log=SkipLog(skipped))

    def adopt(
        self, state: TrainState, batch: tuple[Any, Any], unavailable: Collection[Any] = ()
    ) -> tuple[TrainState, int]:
        """`state` moved into this step's device layout.

        Devices that run the same stages keep their rows; a device new to its
        stages copies them from a live peer.

        Args:
            state: a TrainState of this model, from any pipeline of it.
            batch: an (x, y) pair shaped like the batches to come.
            unavailable: devices (failed ones) that are never read.

        Returns:
            (the state in this layout, the bytes that moved to get it there).

        Raises:
            StateError: `state` is no live TrainState of this model, holds another
                optimizer's state, or has microbatches in flight in another layout.
            BatchError: `batch` is not the pair (x, y), x and y differ in batch
                size, or it is not divisible by data*microbatches.
        """
        _, view = self._state_program(state, batch)
        return self._into(view, state, unavailable)

    def _state_program(
        self, state: TrainState, batch: tuple[Any, Any], rngs: Any = None
    ) -> tuple[Any, StateView]:
        """`_program` for a state's parameters, after checking the call's arguments:
        StateError for anything but a live TrainState of this model, BatchError for
        a batch that is not the pair (x, y)."""
        if not isinstance(state, TrainState):
            raise StateError(
                f"state: expected a TrainState, got {type(state).__name__}; build one with "
                "state = step.init(params, (x, y))"
            )
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            got = f"shape {np.shape(batch)}" if hasattr(batch, "shape") else type(batch).__name__
            raise BatchError(
                f"batch: expected the pair (x, y), got {got}; call step(state, (x, y))"
            )
        state.check_alive("state")
        leaves, tree = jax.tree.flatten(tuple(batch))
        signature = (tree, *((np.shape(a), jnp.result_type(a)) for a in leaves))
        streams = tuple(sorted(rngs or ()))
        last = self._last
        if last is not None and last[0] is state.view and last[1:3] == (signature, streams):
            return last[3]
        try:
            found = self._program(state.view.variables, batch, rngs, state.view.boxed)
        except flax.errors.ScopeParamShapeError as e:
            raise StateError(
                f"state: its parameters do not fit this model ({str(e).splitlines()[0]}); "
                "it belongs to another model: build a state with step.init(params, (x, y))"
            ) from None
        self._last = (state.view, signature, streams, found)
        return found

    @staticmethod
    def _into(
        view: StateView, state: TrainState, unavailable: Collection[Any] = ()
    ) -> tuple[TrainState, int]:
        if state.view is view:
            return state, 0
        theirs, ours = (jax.tree.structure(v.opt_template) for v in (state.view, view))
        if theirs != ours:
            raise StateError(
                f"state: its optimizer state is another optimizer's ({theirs.num_leaves} "
                f"leaves; this step's optimizer has {ours.num_leaves}); start a fresh one "
                "with step.init(state.params, (x, y)), or step with the optimizer it was made by"
            )
        if state.in_flight is not None:
            raise StateError(
                "state: it has microbatches in flight in another program's layout (a "
                "carrying async-1f1b step); call that step's flush(state) first"
            )
        try:
            params, opt, moved = view.layout.relayout(
                state.view.layout, state.device_params, state.device_opt, unavailable
            )
        except ValueError:  # another chunk layout or row format
            if view.cut is state.view.cut:
                # The same stages: each stage's trees go straight to its new rows, so
                # every leaf stays on its stage's devices (the module layout would
                # put one stage's step count on every stage, which a process of a
                # multi-process job may hold no copy of).
                stages = state.view.layout.to_stages(
                    state.device_params, state.device_opt, unavailable
                )
                params, opt = view.layout.from_stages(*stages)
            else:  # another stage cut: via the module layout
                params, opt = state.view.to_module(state, unavailable)
                params, opt = view.to_device(params, opt)
            moved = sum(b.nbytes for b in jax.tree.leaves((params, opt)))  # at most this
        return TrainState(params, opt, state.step, view, skip_log=state.skip_log), moved

    def __call__(
        self, state: TrainState, batch: tuple[Any, Any], rngs: Any = None
    ) -> tuple[TrainState, jax.Array]:
        """One optimizer step.

        Args:
            state: the TrainState the last step returned (or `init` made).
            batch: the global batch, the pair (x, y).
            rngs: a key or {stream: key} for a model that draws random numbers,
                as in `Pipelined.value_and_grad`.

        Returns:
            (the new state, the loss before the update).

        Raises:
            StateError: `state` is no live TrainState of this model, or has
                microbatches in flight for a step without carry.
            BatchError: `batch` is not the pair (x, y), x and y differ in batch
                size, or it is not divisible by data*microbatches.
            RngError: `rngs` with carry.
            OptionError: skip_nonfinite=True on a schedule that steps in its loop.
        """
        rngs = step_rngs(rngs)
        step, view = self._state_program(state, batch, rngs)
        state, _ = self._into(view, state)
        x, y = self.pipelined.place(batch)
        if self.carry:
            if rngs is not None:
                raise RngError(
                    "rngs: a carrying step (carry=True) with per-microbatch rngs (dropout) "
                    "is not supported yet; make the model deterministic or drop carry"
                )
            params, opt, in_flight, loss = step.carry_train_step(
                state.device_params, state.device_opt, state.in_flight, x, y, donate=self.donate
            )
            self._carried_by[view] = step
            return TrainState(params, opt, state.step + 1, view, in_flight, state.skip_log), loss
        if state.in_flight is not None:
            raise StateError(
                "state: it has microbatches in flight (from a carrying step, "
                "train_step(..., carry=True)); call that step's flush(state) first"
            )
        skip = self._skips(step)
        params, opt, loss, skipped = step.device_train_step(
            state.device_params, state.device_opt, x, y, self.donate, rngs, skip
        )
        # This step is dispatched: the earlier steps' flags are read while it runs.
        log = state.skip_log.settled()
        if skip:
            log = log.then(state.step, skipped, loss)
        return TrainState(params, opt, state.step + 1, view, skip_log=log), loss

    def _skips(self, step: PipelineStep) -> bool:
        """Whether `step` runs with the non-finite check (PipelineOptions.skip_nonfinite)."""
        wanted = self.pipelined.options.skip_nonfinite
        if wanted and step.steps_in_loop:
            raise OptionError(
                "skip_nonfinite=True: this schedule steps each stage's optimizer inside the "
                "tick loop, before the loss is known; leave skip_nonfinite None or False"
            )
        return wanted is not False and not step.steps_in_loop

    def flush(self, state: TrainState) -> tuple[TrainState, jax.Array | None]:
        """Finish the microbatches in flight (a carrying step's drain).

        Args:
            state: the state a carrying step of this TrainStep returned.

        Returns:
            (the state with exact parameters and nothing in flight, the mean loss
            of the last step's batch); (state, None) when nothing is in flight.

        Raises:
            StateError: `state` was consumed, or another TrainStep carried it.
        """
        if state.in_flight is None:
            return state, None
        state.check_alive("flush")
        step = self._carried_by.get(state.view)
        if step is None:
            raise StateError(
                "flush: this state's microbatches in flight were not carried by this "
                "TrainStep; flush with the step that made the state"
            )
        params, opt, _, loss = step.carry_train_step(
            state.device_params, state.device_opt, state.in_flight, drain=True, donate=self.donate
        )
        return TrainState(params, opt, state.step, state.view, skip_log=state.skip_log), loss

    def compile(self, state: TrainState, batch: tuple[Any, Any]) -> float:
        """Compile ahead of time.

        Args:
            state: a TrainState like the ones the step will take.
            batch: (x, y) shaped like the batches to come (arrays or
                ShapeDtypeStructs).

        Returns:
            The seconds the compile took.

        Raises:
            StateError: a carrying step, or `state` is no live TrainState of this model.
            BatchError: `batch` is not the pair (x, y), x and y differ in batch
                size, or it is not divisible by data*microbatches.
        """
        if self.carry:
            raise StateError(
                "compile: a carrying step (carry=True) compiles on its first call; "
                "call it instead, or compile a step without carry"
            )
        step, _ = self._state_program(state, batch)
        sharding = NamedSharding(self.pipelined.device_mesh, PartitionSpec())
        x, y = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=sharding),
            batch,
        )
        return step.compile_device_train_step(x, y, self.donate, self._skips(step))
