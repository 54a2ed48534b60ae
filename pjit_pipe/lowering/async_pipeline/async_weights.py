"""Which weights the ops of an asynchronous 1F1B program read: predict, stash or latest.

An asynchronous schedule (per-microbatch OPTs, `Schedule.asynchronous`) steps
each stage after every backward, so s updates land on position p between a
microbatch's forward and its backward. The stepping tick loop
(`StageOptimizer.stepping_loop`, optimizer.py) asks an `AsyncWeights` for the parameters each tick's
forward and backward read, and tells it about every optimizer step:

- ``latest``: both read the current weights (PipeDream without stashing:
  the backward differentiates at other weights than the forward ran with);
- ``stash``: the forward stores the version it read in a slot of its own, the
  backward reads it back (PipeDream's weight stashing). The slot is the
  microbatch's residual slot, so the stash holds as many versions as the
  position has microbatches in flight (s + 1), sized like the residual store;
- ``predict``: the forward reads W + s * u, u the last applied update
  (PipeOptim, see `weight_prediction`); the backward and the update use W.

Each step applies one microbatch's gradient: the summed replica gradients of
one microbatch, scaled to that microbatch's mean loss (a factor m over the
iteration mean the ops accumulate), so m steps per iteration each see a
minibatch of 1/m of the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pjit_pipe.errors import LossFnError, OptionError
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.async_pipeline.weight_prediction import recognise
from pjit_pipe.lowering.compute.loss import LossLayout
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec
from pjit_pipe.lowering.tick_plan import TickRow

MODES = ("predict", "stash", "latest")


def staleness(schedule: Schedule, position: int) -> int:
    """Updates between a microbatch's forward and its backward on `position`: the
    forwards its program runs before its first backward, less one (PipeDream's s)."""
    prog = schedule.program(next(w for w in schedule.alive_workers if w.stage == position))
    first_back = next(i for i, op in enumerate(prog) if op.kind in (Kind.B, Kind.BW, Kind.W))
    return sum(op.kind is Kind.F for op in prog[:first_back]) - 1


class AsyncWeights:
    """The weight policy of one asynchronous program (module docstring).

    staleness_offset: added to every position's s in the prediction (PipeOptim's
    code predicts P - p steps ahead, one more than the paper's s = P - p - 1).
    """

    def __init__(
        self,
        mode: str,
        schedule: Schedule,
        optimizer: optax.GradientTransformation | None,
        stage_param_avals: list[Any],
        remat: bool,
        staleness_offset: int = 0,
    ):
        if mode not in MODES:
            raise OptionError(f"async_weights must be one of {', '.join(MODES)}, got {mode!r}")
        if schedule.chunks != 1:
            raise OptionError(f"async_weights: needs chunks=1, got chunks={schedule.chunks}")
        if mode == "stash" and remat:
            raise OptionError(
                "async_weights='stash' keeps each version in its microbatch's residual "
                "slot, which remat=True does not have; use remat=False or another mode"
            )
        if mode == "predict" and optimizer is not None:
            recognise(jax.eval_shape(optimizer.init, stage_param_avals[0]))
        if not isinstance(staleness_offset, int) or staleness_offset < 0:
            raise OptionError(f"staleness_offset must be an int >= 0, got {staleness_offset!r}")
        self.mode = mode
        self.microbatches = schedule.microbatches
        # Per pipeline position: the prediction's horizon s (+ offset).
        self.horizon = np.array(
            [staleness(schedule, p) + staleness_offset for p in range(schedule.stages)],
            np.float32,
        )
        # Whether a forward reads weights ahead of the current ones. Where every
        # horizon is 0 (one stage, no offset) W + 0 * u is W itself: no u is kept,
        # which saves a pass over the weights every tick and every step.
        self.predicts = mode == "predict" and bool(self.horizon.any())

    def extra_copies(self, res_slots: int) -> int:
        """Parameter-sized buffers each device holds beyond its weights."""
        return {"predict": int(self.predicts), "stash": res_slots + 1, "latest": 0}[self.mode]

    def extra_bytes(self, param_spec: FlatSpec, res_slots: int) -> int:
        """Bytes of those buffers per device (one chunk: async-1f1b has chunks=1)."""
        row = sum(param_spec.nbytes(k) for k in param_spec.sizes)
        return self.extra_copies(res_slots) * row

    def init(self, params: Buffers, res_slots: int) -> Buffers:
        """The carried buffers: predict: u, the last update, (v, L) rows (none where
        no horizon is above 0); stash: (res_slots + 1, v, L) versions, the last one
        a scratch slot; latest: none."""
        if self.predicts:
            return {k: jnp.zeros_like(b) for k, b in params.items()}
        if self.mode == "stash":
            return {k: jnp.zeros((res_slots + 1, *b.shape), b.dtype) for k, b in params.items()}
        return {}

    def views(
        self, params: Buffers, carry: Buffers, row: TickRow, pos: jax.Array
    ) -> tuple[Buffers, Buffers, Buffers]:
        """(what this tick's forward reads, what its backward reads, the new carry).

        An asynchronous table runs one op per device per tick (pack_ticks does not
        pack it), so the backward lane is B's or else W/BW's."""
        if self.predicts:
            s = jnp.asarray(self.horizon)[pos]
            ahead = {k: b + (s * carry[k]).astype(b.dtype) for k, b in params.items()}
            return ahead, params, carry
        if self.mode == "stash":
            # The forward's version goes to its residual slot (scratch on other ticks).
            carry = {k: c.at[row.f.res_w].set(params[k]) for k, c in carry.items()}
            back = jnp.where(row.b.branch > 0, row.b.res_r, row.w.res_r)
            return params, {k: c[back] for k, c in carry.items()}, carry
        return params, params, carry

    def after_step(self, carry: Buffers, old: Buffers, new: Buffers, mine: jax.Array) -> Buffers:
        """Record the update of the chunks that stepped (`mine`: (v, 1) bool)."""
        if not self.predicts:
            return carry
        return {k: jnp.where(mine, new[k] - old[k], c) for k, c in carry.items()}

    def step_gradients(self, grads: Buffers) -> Buffers:
        """Reduced gradients (an m-microbatch mean's share) -> one microbatch's mean."""
        return {k: g * jnp.asarray(self.microbatches, g.dtype) for k, g in grads.items()}


def async_weights_for(
    schedule: Schedule,
    mode: str | None,
    optimizer: optax.GradientTransformation | None,
    stage_param_avals: Sequence[Any],
    remat: bool,
    loss: LossLayout,
    staleness_offset: int = 0,
) -> AsyncWeights | None:
    """The weight policy `lower` compiles: None for a synchronous schedule (where
    `mode` must be None); `mode` None means "predict"."""
    if not schedule.asynchronous:
        if mode is not None:
            raise OptionError(
                f"async_weights={mode!r} applies to an asynchronous schedule (async-1f1b) "
                f"only, not {schedule.kind!r}; drop it or use schedule async-1f1b"
            )
        return None
    if loss.weighted:
        raise LossFnError(
            "async-1f1b with a weighted loss ((loss_sum, weight) pairs) is not supported "
            "yet: each microbatch's step would need its own weight; return a mean loss"
        )
    return AsyncWeights(
        mode or "predict", schedule, optimizer, list(stage_param_avals), remat, staleness_offset
    )
