"""`TrainStep`: one optimizer step of a pipelined model, its state kept in device layout."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pjit_pipe.errors import RngError, StateError
from pjit_pipe.frontend.rngs import step_rngs
from pjit_pipe.frontend.state import StateView, TrainState
from pjit_pipe.frontend.tensor_split import unbox

if TYPE_CHECKING:
    from pjit_pipe.frontend.pipelined import LossFn, Pipelined
    from pjit_pipe.lowering.step import PipelineStep


class TrainStep:
    """step(state, (x, y)) -> (new state, loss before the update); step.init(params, batch).

    The state stays in this pipeline's device layout between steps (see
    frontend/state.py): the compiled step takes and returns each device's own
    rows, donated unless `donate` is False. A state from another pipeline
    (another mesh, a failure variant) is moved into this layout first.

    With `carry` (async-1f1b only) a step does not drain the pipeline: the
    microbatches in flight at its end stay in `state.in_flight` and the next
    step goes on from them (lowering/async_carry.py). Its loss is then the
    previous step's batch's (NaN at the first step), and `flush(state)`
    finishes the microbatches in flight: call it before reading exact
    parameters, saving a checkpoint or switching programs.
    """

    def __init__(
        self, pipelined: Pipelined, loss_fn: LossFn, donate: bool = True, carry: bool = False
    ):
        self.pipelined = pipelined
        self.loss_fn = loss_fn
        self.donate = donate
        if carry:
            from pjit_pipe.lowering.async_carry import check_carry  # the compiler: on first use

            check_carry(pipelined.schedule, rngs=False)
        self.carry = carry
        # The program of each state view this step has carried microbatches in (flush runs it).
        self._carried_by: dict[StateView, PipelineStep] = {}

    def _program(
        self, params: Any, batch: tuple[Any, Any], rngs: Any = None, boxed: Any = None
    ) -> tuple[Any, StateView]:
        """The compiled pipeline for these shapes (and rng streams) and its state view;
        `boxed`: the annotated params that say how weights split over 'tensor'."""
        cut, step = self.pipelined.program(params, *batch, self.loss_fn, rngs=rngs, boxed=boxed)
        return step, self.pipelined.state_view(cut, step, boxed)

    def _state_program(
        self, state: TrainState, batch: tuple[Any, Any], rngs: Any = None
    ) -> tuple[Any, StateView]:
        return self._program(state.view.variables, batch, rngs, state.view.boxed)

    def view(self, params: Any, batch: tuple[Any, Any]) -> StateView:
        """The state view (module layout <-> this step's device layout) for parameters
        shaped like `params` (arrays or ShapeDtypeStructs, boxed or not) and batches
        like `batch`."""
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
    ) -> TrainState:
        """A TrainState from module-layout `params` (and `opt_state`, default a fresh
        `optimizer.init`; `step`, e.g. from a checkpoint); `batch` is an example
        (x, y) that fixes the stage cut, and `rngs` an example key for a model that
        draws random numbers. Each stage's rows are built on its devices."""
        model = self.pipelined.model
        params, boxed = unbox(params)  # annotated weights: how they split over 'tensor'
        params = model.variables(model.params(params))  # e.g. an nnx.State -> its pure dict
        _, view = self._program(params, batch, step_rngs(rngs), boxed)  # checks the optimizer
        device_params, device_opt = view.to_device(params, unbox(opt_state)[0])
        return TrainState(device_params, device_opt, step, view)

    def adopt(
        self, state: TrainState, batch: tuple[Any, Any], unavailable: Collection[Any] = ()
    ) -> tuple[TrainState, int]:
        """`state` in this step's device layout, and the bytes that moved to get it
        there. Devices that run the same stages keep their rows; a device new to
        its stages copies them from a live peer; `unavailable` devices (failed
        ones) are never read."""
        _, view = self._state_program(state, batch)
        return self._into(view, state, unavailable)

    @staticmethod
    def _into(
        view: StateView, state: TrainState, unavailable: Collection[Any] = ()
    ) -> tuple[TrainState, int]:
        if state.view is view:
            return state, 0
        if state.in_flight is not None:
            raise StateError(
                "state: it has microbatches in flight in another program's layout (a "
                "carrying async-1f1b step); call that step's flush(state) first"
            )
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
            return TrainState(params, opt, state.step + 1, view, in_flight), loss
        if state.in_flight is not None:
            raise StateError(
                "state: it has microbatches in flight (from a carrying step, "
                "train_step(..., carry=True)); call that step's flush(state) first"
            )
        params, opt, loss = step.device_train_step(
            state.device_params, state.device_opt, x, y, self.donate, rngs
        )
        return TrainState(params, opt, state.step + 1, view), loss

    def flush(self, state: TrainState) -> tuple[TrainState, jax.Array | None]:
        """Finish the microbatches in flight (a carrying step's drain): (the state
        with exact parameters and nothing in flight, the mean loss of the last
        step's batch); (state, None) when nothing is in flight."""
        if state.in_flight is None:
            return state, None
        step = self._carried_by.get(state.view)
        if step is None:
            raise StateError(
                "flush: this state's microbatches in flight were not carried by this "
                "TrainStep; flush with the step that made the state"
            )
        params, opt, _, loss = step.carry_train_step(
            state.device_params, state.device_opt, state.in_flight, drain=True, donate=self.donate
        )
        return TrainState(params, opt, state.step, state.view), loss

    def compile(self, state: TrainState, batch: tuple[Any, Any]) -> float:
        """Compile ahead of time for states like this one and batches shaped like
        `batch` (arrays or ShapeDtypeStructs); returns the seconds it took."""
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
        return step.compile_device_train_step(x, y, self.donate)
