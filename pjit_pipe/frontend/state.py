"""The training state: kept in the device layout, seen in the module's layout.

Between steps a `TrainState` holds the compiled pipeline's device layout
(see lowering/layout/device_state.py): each device has the parameter and optax-state
rows of the stages it runs, and the train step takes and returns exactly
that, so no step gathers the model. `state.params` and `state.opt_state` are
the user's view, the module's own trees (`module.init`, `optimizer.init`
layout, what checkpoints store), derived on demand: each leaf is placed on the
devices of the stage that owns it, never the whole model on one device.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import flax.struct
import jax
import optax

from pjit_pipe.errors import StateError
from pjit_pipe.frontend.cutter.cut import StageCut
from pjit_pipe.frontend.cutter.tensor_split import rebox
from pjit_pipe.frontend.opt_state import merge_opt_state, split_opt_state
from pjit_pipe.frontend.skip_log import SkipLog
from pjit_pipe.lowering import Buffers, DeviceLayout, device_bytes


class StateView:
    """Converts between one program's device layout and the module layout.

    cut: the stage cut (module tree <-> per-stage trees); layout: the program's
    device layout; optimizer: its optax transformation (for the module-layout
    optax state's tree).
    """

    def __init__(
        self,
        cut: StageCut,
        layout: DeviceLayout,
        optimizer: optax.GradientTransformation,
        boxed: Any = None,
    ):
        self.cut = cut
        self.boxed = boxed  # annotated params (tensor_split.unbox): state.params comes back boxed
        self.layout = layout
        self.optimizer = optimizer
        self.variables = cut.model.variables(cut.param_avals)  # module params' shapes
        self.opt_template = jax.eval_shape(optimizer.init, self.variables)

    def to_device(self, params: Any, opt_state: Any = None) -> tuple[Buffers, Buffers]:
        """Module-layout params (and optax state; None: a fresh optimizer.init)
        -> the (params, opt) buffers of the device layout."""
        stage_params = self.cut.split(params)
        stage_opt = None if opt_state is None else split_opt_state(self.cut, opt_state, params)
        return self.layout.from_stages(stage_params, stage_opt)

    def module_avals(self) -> dict[str, Any]:
        """{'params', 'opt_state'} of the module layout as ShapeDtypeStructs, each
        leaf placed on the devices of the stage that owns it (a restore target)."""
        layout, held = self.layout, self.layout.held
        where = {s: p for p, stages in enumerate(held) for s in stages}

        def placed(tree: Any, s: int) -> Any:
            sharding = layout.stage_sharding(where[s])
            return jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
            )

        stage_params = self.cut.split(self.variables)
        params = [placed(t, s) for s, t in enumerate(stage_params)]
        opts = [
            placed(jax.eval_shape(self.optimizer.init, t), s) for s, t in enumerate(stage_params)
        ]
        return {
            "params": self.cut.merge(params),
            "opt_state": merge_opt_state(self.cut, opts, self.opt_template, self.variables),
        }

    def to_module(self, state: TrainState, skip: Collection[Any] = ()) -> tuple[Any, Any]:
        """(params, opt_state) in the module layout, each leaf on the devices of the
        stage that owns it; the devices in `skip` are not read."""
        state.check_alive("state")
        stage_params, stage_opt = self.layout.to_stages(state.device_params, state.device_opt, skip)
        params = self.cut.merge(stage_params)
        return params, merge_opt_state(self.cut, stage_opt, self.opt_template, params)


@flax.struct.dataclass
class TrainState:
    """Training state of a pipelined model, in the device layout.

    `params` and `opt_state` give the module-layout view (see the module doc).

    Attributes:
        device_params: per buffer (a size class of leaves, or a dtype's flat
            row), a (devices, v, L) array sharded by its leading axis: row i holds
            device i's chunks' parameters, flattened and padded.
        device_opt: the same for each chunk's optax state.
        step: number of optimizer steps taken (asynchronous schedules: batches fed);
            a skipped non-finite step counts as taken (it used its batch).
        view: how to read the buffers as the module's trees (static).
        in_flight: the microbatches still in flight after a carrying step of an
            asynchronous schedule (lowering/async_pipeline/async_carry.py), None
            when none are: `params` then lacks their updates until `TrainStep.flush`.
        skip_log: the steps skipped because their loss or global gradient norm
            was not finite, their flags read lazily (skip_log.py); `skipped`
            counts them (see docs/faults.md).
    """

    device_params: Buffers
    device_opt: Buffers
    step: int = flax.struct.field(pytree_node=False, default=0)
    view: StateView | None = flax.struct.field(pytree_node=False, default=None)
    in_flight: Any = None
    skip_log: SkipLog = flax.struct.field(pytree_node=False, default=SkipLog())

    @property
    def skipped(self) -> int:
        """How many of the steps taken were skipped as not finite.

        Reading it waits for the steps whose flags are not read yet, and gives
        the RuntimeWarning of each skipped one among them.

        Returns:
            The count of skipped steps.
        """
        return self.skip_log.count()

    def check_alive(self, where: str) -> None:
        """Raise StateError when a step consumed (donated) this state's buffers.

        Reading them would crash the process on some backends.

        Args:
            where: what is being read, the start of the error message.

        Raises:
            StateError: a step consumed (donated) this state's buffers.
        """
        leaves = jax.tree.leaves((self.device_params, self.device_opt, self.in_flight))
        if any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
            raise StateError(
                f"{where}: this TrainState was consumed by an earlier step (its buffers "
                "were donated to it); use the state that step returned, or keep copies "
                "with pipelined.train_step(loss_fn, donate=False)"
            )

    @property
    def params(self) -> Any:
        """The module's parameters, derived from the device layout on each read.

        Returns:
            The module's parameter tree ({'params': ...} in linen), leaves on their
            stage's devices, in the boxes (nn.Partitioned, ...) that `init` was given.

        Raises:
            StateError: a step consumed (donated) this state's buffers.
        """
        return rebox(self.view.to_module(self)[0], self.view.boxed)

    @property
    def opt_state(self) -> Any:
        """The optax state in the module layout, derived from the device layout.

        Returns:
            `optimizer.init(params)`'s tree with the current values, leaves on
            their stage's devices.

        Raises:
            StateError: a step consumed (donated) this state's buffers.
        """
        return self.view.to_module(self)[1]

    def module_state(self) -> dict[str, Any]:
        """What a checkpoint stores.

        Returns:
            {'params', 'opt_state', 'step'} in the module layout.

        Raises:
            StateError: a step consumed (donated) this state's buffers.
        """
        params, opt_state = self.view.to_module(self)
        return {"params": params, "opt_state": opt_state, "step": self.step}

    def device_bytes(self) -> dict[Any, int]:
        """Bytes of this state on each device.

        Returns:
            Per device, the bytes of its parameter and optax-state rows.
        """
        return device_bytes(self.device_params, self.device_opt)
