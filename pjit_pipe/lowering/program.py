"""Schedule -> one jitted shard_map program: the tick loop, the reduction, the optimizer.

Every device scans over the ticks of the schedule's lockstep table. In each
tick it runs one `lax.switch` branch (idle, or F/B/W/BW of one virtual stage)
chosen by its own table row, then every ppermute of the schedule runs
unconditionally and the received messages are stored in the slots the plan
assigned. After the scan the parameter gradients are summed over the live
replicas of each stage and, for a training step, each held stage's optax
update runs on its device.

A schedule with failed workers compiles the same way over the survivors only
(see topology.py); it is the same step, on the same global batch.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.validate import validate
from pjit_pipe.lowering.async_weights import AsyncWeights, async_weights_for
from pjit_pipe.lowering.device_state import DeviceLayout
from pjit_pipe.lowering.global_norm import SUM, StageNorms, count_norm_calls, stage_norms
from pjit_pipe.lowering.loss import LossLayout
from pjit_pipe.lowering.messages import MessageSpec
from pjit_pipe.lowering.packing import Buffers, FlatSpec
from pjit_pipe.lowering.plan import (
    BRANCH,
    G_SLOT,
    IN_SLOT,
    ITER,
    MB,
    RECV0,
    RES_R,
    RES_W,
    SELF_SLOT,
    UPDATE,
    TickPlan,
    build_plan,
)
from pjit_pipe.lowering.rng import check_rngs, impls_of, microbatch_key_data, microbatch_rngs
from pjit_pipe.lowering.shared import SharedGrads, check_shared
from pjit_pipe.lowering.stages import StageVjp
from pjit_pipe.lowering.topology import AXES, Topology


def _row(bufs: Buffers, i: Any) -> Buffers:
    return {k: lax.dynamic_index_in_dim(b, i, keepdims=False) for k, b in bufs.items()}


class Lowered:
    """The traced pieces of one (schedule, model, shapes): branches and the device body."""

    def __init__(
        self,
        schedule: Schedule,
        stages: StageVjp,
        topology: Topology,
        remat: bool,
        iterations: int = 1,
        shared: Mapping[str, Sequence[int]] | None = None,
        *,
        loss: LossLayout,
        rng_impls: dict[str, Any] | None = None,
        weights: AsyncWeights | None = None,
    ):
        self.sched = schedule
        self.st = stages
        self.loss = loss  # what the last stage's loss vector holds (stages.loss_fn = loss.vector)
        # Stream name -> key impl when steps take rngs (the batch is then (x, key data)).
        self.rng_impls = rng_impls
        self.weights = weights  # an asynchronous schedule's weight policy (async_weights.py)
        self.topo = topology
        self.iterations = iterations
        keyed = rng_impls is not None  # every op reads its microbatch's keys
        self.plan: TickPlan = build_plan(schedule, remat, topology.workers, 1, keyed)
        # Staggered or multi-iteration training runs the optimizer inside the loop.
        self.stepping = schedule.staggered or iterations > 1
        self.step_plan: TickPlan | None = None
        if self.stepping:
            self.step_plan = (
                self.plan
                if iterations == 1
                else build_plan(schedule, remat, topology.workers, iterations, keyed)
            )
        self.remat = remat
        self.param_spec = FlatSpec(stages.param_avals)
        self.msg_spec = MessageSpec(stages.act_avals[1:])
        self.shared = None
        if shared:
            self.shared = SharedGrads(
                shared,
                self.param_spec,
                [schedule.held_stages(p) for p in range(schedule.stages)],
                topology.positions,
                topology.axes,
            )
        self.scale = 1.0 / (schedule.replicas * schedule.microbatches)
        self.loss_mult = self.loss.accumulate_scale(self.scale)
        self.held = [schedule.held_stages(p) for p in range(schedule.stages)]
        spec = self.param_spec
        self.uniform = [
            len({(spec.treedefs[s], tuple(spec.avals[s])) for s in chunk}) == 1
            for chunk in zip(*self.held, strict=True)
        ]
        self.forwards = self._group((Kind.F,))
        self.input_grads = self._group((Kind.B,))
        # One W/BW group per chunk: the chunk's gradient is a static operand.
        self.weight_grads = [
            self._group((Kind.W, Kind.BW), chunk=c) for c in range(schedule.chunks)
        ]

    # ---- the compute of one tick, by op kind ----
    #
    # A tick runs at most one op, chosen in groups, each its own two-way
    # `lax.cond` (an op of this group, or nothing): all F (they write the
    # residual store), all B, and the W/BW of each chunk (they add into that
    # chunk's gradient accumulator). Each store is updated in place inside the
    # one cond that writes it: XLA keeps two-way conds in place but copies
    # every operand through an n-way switch, and a single switch would also
    # have to return a zero gradient and zero residuals on the ticks that make
    # none, one parameter-sized memory pass per tick.

    def _group(
        self, kinds: tuple[Kind, ...], chunk: int | None = None
    ) -> tuple[list[int], list[Callable]]:
        """(branch ids, stage functions) of the plan's branches of these kinds
        (and of virtual stages in this chunk, if given)."""
        ids = [
            1 + i
            for i, (k, s) in enumerate(self.plan.branches)
            if k in kinds and chunk in (None, self.sched.chunk_of(s))
        ]
        return ids, [self._op(*self.plan.branches[i - 1]) for i in ids]

    def _op(self, kind: Kind, s: int) -> Callable:
        """One (kind, virtual stage): (msg, residual row or parameter gradient, loss share)."""
        S, c, st = self.st.S, self.sched.chunk_of(s), self.st

        def stage_input(x, msgs, row):
            if s == 0:
                return jax.tree.map(lambda a: a[row[MB]], x)
            return self.msg_spec.unpack_act(s - 1, _row(msgs, row[IN_SLOT]))

        def run(params, x, y, msgs, res, row):
            msg = self.msg_spec.zeros()
            p = params[c] if self.uniform[c] else self.param_spec.unpack(s, params[c])
            y_mb = jax.tree.map(lambda a: a[row[MB]], y) if s == S - 1 else None
            if kind is Kind.F:
                a = stage_input(x, msgs, row)
                if self.remat:
                    out, res_out = st.forward(s, p, a, y_mb), {}
                else:
                    out, res_out = st.forward_with_residuals(s, p, a, y_mb)
                if s == S - 1:
                    return msg, res_out, out * self.loss_mult
                return self.msg_spec.pack_act(s, out), res_out, self._no_loss()
            if s == S - 1:
                g = self.loss.seed(self.scale)
            else:
                g = self.msg_spec.unpack_grad(s, _row(msgs, row[G_SLOT]))
            r = _row(res, row[RES_R])
            # B's residual write: a split stage's cotangents at their offset; any other
            # stage's B rewrites what is there (a B group of several stages needs one shape).
            put = {k: (res[k][row[RES_R], :w], 0) for k, w in st.cot_width.items()}
            if s in st.split:  # see split_backward.py
                if kind is Kind.B:
                    dinput, cots = st.input_grad(s, p, r, g)
                    put = {k: (cots[k], off) for k, off in st.cot_offset(s).items()}
                elif kind is Kind.W:
                    dparams, dinput = st.weight_grad(s, p, r), None
                else:
                    dparams, dinput = st.fused_grad(s, p, r, g)
            else:
                if self.remat:
                    pull = st.recompute_pullback(s, p, stage_input(x, msgs, row), y_mb)
                else:
                    pull = st.pullback(s, p, r)
                dparams, dinput = pull(g) if s > 0 else (pull(g)[0], None)
            if kind in (Kind.B, Kind.BW) and s > 0:
                msg = self.msg_spec.pack_grad(s - 1, dinput)
            if kind is Kind.B:
                return msg, put, self._no_loss()
            # A uniform chunk's gradient stays a tree (see `_zero_grads`).
            dpar = dparams if self.uniform[c] else self.param_spec.pack(s, dparams)
            return msg, dpar, self._no_loss()

        return run if self.rng_impls is None else self._with_rngs(run)

    def _with_rngs(self, op: Callable) -> Callable:
        """op with its microbatch's keys in scope (see rng.py); the device batch is
        (x, per-microbatch key data), split like x."""

        def run(params, batch, y, msgs, res, row):
            x, keys = batch
            mine = {k: d[row[MB], 0] for k, d in keys.items()}
            with microbatch_rngs(mine, self.rng_impls):
                return op(params, x, y, msgs, res, row)

        return run

    def _no_loss(self) -> jax.Array:
        """The loss-vector share of an op that computes no loss (see loss.py)."""
        return jnp.zeros((self.loss.size,), jnp.float32)

    # ---- the device program ----

    def chunk_params(self, params: Buffers) -> list[Any]:
        """Per chunk: its parameter rows, unpacked once here when every position's
        stage of that chunk has the same parameter shapes (no per-tick slicing)."""
        out = []
        for c, uniform in enumerate(self.uniform):
            row = {k: b[c] for k, b in params.items()}
            out.append(self.param_spec.unpack(self.held[0][c], row) if uniform else row)
        return out

    def _empty(self, plan: TickPlan):
        """Message store (with a scratch slot for no message), residual store, gradients."""
        K, R = plan.msg_slots, plan.res_slots
        return (
            self.msg_spec.zeros(K + 1),
            {} if self.remat else self.st.res_spec.zeros(R),
            self._zero_grads(),
        )

    def _zero_grads(self) -> list[Any]:
        """Per chunk, the gradient accumulator: the parameter tree itself when every
        position's stage of the chunk has the same shapes (W adds leaf by leaf),
        else a flat row (W packs its tree first, a copy per W)."""
        zeros = self.param_spec.zeros()
        return [
            self.param_spec.unpack(self.held[0][c], zeros) if uniform else zeros
            for c, uniform in enumerate(self.uniform)
        ]

    def _flat_grads(self, grads: list[Any]) -> Buffers:
        """Per-chunk accumulators -> the (v, L) gradient rows of the device layout."""
        rows = [
            self.param_spec.pack(self.held[0][c], g) if self.uniform[c] else g
            for c, g in enumerate(grads)
        ]
        return {k: jnp.stack([r[k] for r in rows]) for k in self.param_spec.sizes}

    def _tick(self, plan: TickPlan, params, x, y, msgs, res, grads, row, back_params=None):
        """One tick: this device's op (if any), then every ppermute of the plan.
        B and W read `back_params` when given (asynchronous weights), else `params`."""
        msg = self.msg_spec.zeros()
        loss = self._no_loss()
        args = (params, x, y, msgs)
        back_args = args if back_params is None else (back_params, x, y, msgs)

        def dispatch(group, *operands):
            ids, fns = group
            if len(fns) == 1:
                return fns[0](*operands)
            which = jnp.searchsorted(jnp.asarray(ids, jnp.int32), row[BRANCH])
            return lax.switch(which, fns, *operands)

        def taken(group):
            return jnp.isin(row[BRANCH], jnp.asarray(group[0], jnp.int32))

        if self.forwards[0]:

            def forward(msg, res, loss):
                msg, res_out, loss = dispatch(self.forwards, *args, res, row)
                res = {k: b.at[row[RES_W]].set(res_out[k]) for k, b in res.items()}
                return msg, res, loss

            msg, res, loss = lax.cond(taken(self.forwards), forward, lambda *a: a, msg, res, loss)
        if self.input_grads[0]:

            def input_grad(msg, res):
                msg, put, _ = dispatch(self.input_grads, *back_args, res, row)
                res = dict(res)
                for k, (cots, off) in put.items():  # a split stage's site cotangents
                    res[k] = lax.dynamic_update_slice(res[k], cots[None], (row[RES_R], off))
                return msg, res

            msg, res = lax.cond(taken(self.input_grads), input_grad, lambda *a: a, msg, res)
        grads = list(grads)
        for c, group in enumerate(self.weight_grads):
            if not group[0]:
                continue

            def weight_grad(msg, acc, group=group):
                msg, dpar, _ = dispatch(group, *back_args, res, row)
                return msg, jax.tree.map(jnp.add, acc, dpar)

            msg, grads[c] = lax.cond(taken(group), weight_grad, lambda *a: a, msg, grads[c])
        msgs = {k: b.at[row[SELF_SLOT]].set(msg[k]) for k, b in msgs.items()}
        for i, (_, pairs) in enumerate(plan.shifts):
            got = lax.ppermute(msg, self.topo.axes, perm=pairs)
            msgs = {k: b.at[row[RECV0 + i]].set(got[k]) for k, b in msgs.items()}
        return msgs, res, grads, loss

    def tick_loop(self, params: Buffers, x: Any, y: Any, rows: jax.Array, with_aux: bool = False):
        """Run every tick on this device; return (the loss over the global batch, this
        device's gradient rows reduced over replicas). With `with_aux` the loss is
        (loss, aux) (see loss.py)."""
        params = self.chunk_params(params)

        def tick(carry, row):
            *state, loss = carry
            *state, dloss = self._tick(self.plan, params, x, y, *state, row)
            return (*state, loss + dloss), None

        (_, _, grads, loss), _ = lax.scan(tick, (*self._empty(self.plan), self._no_loss()), rows)
        local = self._flat_grads(grads)
        grads = self.topo.reduce_over_replicas(local)
        if self.shared is not None:
            grads = self.shared(local, grads)
        total = lax.psum(loss, self.topo.axes)
        factor = self.loss.grad_factor(total, self.sched.replicas * self.sched.microbatches)
        if factor is not None:  # a weighted loss: divide by the global batch's weight
            grads = {k: g * factor.astype(g.dtype) for k, g in grads.items()}
        value = self.loss.loss(total, self.sched.replicas * self.sched.microbatches)
        return ((value, self.loss.aux(total)) if with_aux else value), grads

    def stepping_loop(
        self,
        optimizer: optax.GradientTransformation,
        opt_spec: FlatSpec,
        params: Buffers,
        opt: Buffers,
        x: Any,
        y: Any,
        rows: jax.Array,
        updates: jax.Array,
        pos: jax.Array,
    ):
        """Several iterations with each stage's optimizer step inside the tick loop.

        After a tick flagged in `updates` (the same flag on every device, so the
        reduction's collectives run everywhere or nowhere), the chunks whose
        UPDATE bit is set reduce their gradients over their live replicas, take
        the optax step and restart accumulating; later ticks read the new
        parameters. Returns (params, opt state, loss of each iteration).

        A weighted loss divides a chunk's gradients by its iteration's total
        weight at its step: every last-stage F of an iteration precedes every
        W of it, so the psum of the loss vectors then holds the whole weight.
        """
        if self.shared is not None:
            raise ValueError(
                f"shared parameters {sorted(self.shared.units)} (tied weights) need every "
                "holder's gradient before the update: a training step with the optimizer "
                "inside the loop (a staggered or re-routed schedule, iterations > 1) does "
                "not support them yet; untie them or train on an unstaggered schedule"
            )
        plan, v = self.step_plan, self.sched.chunks
        count = self.sched.replicas * self.sched.microbatches
        msgs, res, grads = self._empty(plan)
        weights = self.weights
        # The weight policy's buffers (last update or stashed versions; async_weights.py).
        wcarry = weights.init(params, plan.res_slots) if weights else {}
        # Per iteration, this device's summed loss vectors (see loss.py).
        losses = jnp.zeros((self.iterations, self.loss.size), jnp.float32)
        # Per chunk, the optimizer steps taken so far: the iteration of its next step.
        done = jnp.zeros((v,), jnp.int32)

        def step(row, losses, state):
            grads, params, opt, done, wcarry = state
            mine = ((row[UPDATE] >> jnp.arange(v)) & 1).astype(bool)[:, None]
            g = {k: jnp.where(mine, b, 0) for k, b in self._flat_grads(grads).items()}
            g = self.topo.reduce_over_replicas(g)
            if weights is not None:
                g = weights.step_gradients(g)
            elif self.loss.weighted:  # per chunk, its iteration's count / total weight
                factor = self.loss.grad_factor(lax.psum(losses, self.topo.axes), count)
                f = factor[jnp.minimum(done, self.iterations - 1)][:, None]
                g = {k: b * f.astype(b.dtype) for k, b in g.items()}
            new_p, new_o = self.optimizer_step(optimizer, opt_spec, params, g, opt, pos)
            params = {k: jnp.where(mine, new_p[k], b) for k, b in params.items()}
            opt = {k: jnp.where(mine, new_o[k], b) for k, b in opt.items()}
            if weights is not None:
                wcarry = weights.after_step(wcarry, state[1], params, mine)
            grads = [
                jax.tree.map(lambda a, m=mine[c, 0]: jnp.where(m, 0, a), g)
                for c, g in enumerate(grads)
            ]
            return grads, params, opt, done + mine[:, 0], wcarry

        def tick(carry, inputs):
            row, update = inputs
            msgs, res, grads, losses, params, opt, done, wcarry = carry
            if weights is None:
                chunks, back = self.chunk_params(params), None
            else:
                ahead, behind, wcarry = weights.views(params, wcarry, row, pos)
                chunks, back = self.chunk_params(ahead), self.chunk_params(behind)
            msgs, res, grads, dloss = self._tick(plan, chunks, x, y, msgs, res, grads, row, back)
            losses = losses.at[row[ITER]].add(dloss)
            grads, params, opt, done, wcarry = lax.cond(
                update,
                functools.partial(step, row, losses),
                lambda s: s,
                (grads, params, opt, done, wcarry),
            )
            return (msgs, res, grads, losses, params, opt, done, wcarry), None

        carry = (msgs, res, grads, losses, params, opt, done, wcarry)
        (*_, losses, params, opt, _, _), _ = lax.scan(tick, carry, (rows, updates))
        return params, opt, self.loss.loss(lax.psum(losses, self.topo.axes), count)

    def optimizer_step(
        self,
        optimizer: optax.GradientTransformation,
        opt_spec: FlatSpec,
        params,
        grads,
        opt,
        pos: jax.Array,
    ):
        """Each held stage's OPT: the optax update of its own parameter pytree.

        `pos` is this device's pipeline position (it picks the stages to update).
        An optimizer that takes tree norms (clip_by_global_norm) first runs one
        pass per norm call that only finds its whole-model value (see global_norm.py).
        """

        def stage_args(s, c):
            p = self.param_spec.unpack(s, {k: b[c] for k, b in params.items()})
            g = self.param_spec.unpack(s, {k: b[c] for k, b in grads.items()})
            return p, g, opt_spec.unpack(s, {k: b[c] for k, b in opt.items()})

        known: list[jax.Array] = []
        for k in range(count_norm_calls(optimizer, *self._stage0_avals(optimizer))):
            combine: list[str] = []

            def local_norm(s, c, k=k, combine=combine):
                p, g, o = stage_args(s, c)
                with stage_norms(StageNorms(known, k, self._uncounted(s))) as norms:
                    optimizer.update(g, o, p)
                combine.append(norms.combine)
                return norms.recorded

            known.append(self._across_stages(self._each_chunk(local_norm, pos), combine[0]))

        def update(s, c):
            p, g, o = stage_args(s, c)
            with stage_norms(StageNorms(known, None)) if known else contextlib.nullcontext():
                upd, o = optimizer.update(g, o, p)
            return self.param_spec.pack(s, optax.apply_updates(p, upd)), opt_spec.pack(s, o)

        out = self._each_chunk(update, pos)
        return (
            {k: jnp.stack([p_c[k] for p_c, _ in out]) for k in params},
            {k: jnp.stack([o_c[k] for _, o_c in out]) for k in opt},
        )

    def _uncounted(self, s: int) -> frozenset[str]:
        """Tied units stage s holds whose norm its first holder counts instead."""
        units = self.shared.holders.items() if self.shared is not None else ()
        return frozenset(u for u, holders in units if s in holders and s != min(holders))

    def _stage0_avals(self, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
        p = self.st.param_avals[0]
        return p, jax.eval_shape(optimizer.init, p)

    def _each_chunk(self, fn: Callable[[int, int], Any], pos: jax.Array) -> list[Any]:
        """Per chunk c, fn(s, c) for the stage s this device holds there (a switch
        on the pipeline position: no collective may run inside fn)."""
        out = []
        for c in range(self.sched.chunks):
            stages_c = [self.held[p][c] for p in range(self.sched.stages)]
            which = jnp.asarray(np.argsort(np.argsort(stages_c)), jnp.int32)[pos]
            out.append(lax.switch(which, [functools.partial(fn, s, c) for s in sorted(stages_c)]))
        return out

    def _across_stages(self, per_chunk: list[jax.Array], combine: str) -> jax.Array:
        """Combine one value per stage over the whole model, each stage counted once:
        only the first live holder of each position contributes (replicas hold
        the same stages)."""
        local = functools.reduce(jnp.add if combine == SUM else jnp.maximum, per_chunk)
        first = np.zeros(len(self.topo.workers), bool)
        first[[self.topo.holders(p)[0] for p in range(self.sched.stages)]] = True
        if self.topo.complete:
            me = lax.axis_index("data") * self.sched.stages + lax.axis_index("stage")
        else:
            me = lax.axis_index(self.topo.axes[0])
        local = jnp.where(jnp.asarray(first)[me], local, 0.0)
        return (lax.psum if combine == SUM else lax.pmax)(local, self.topo.axes)


class PipelineStep:
    """A compiled pipeline for one schedule and one set of shapes (see `lower`)."""

    def __init__(
        self,
        schedule: Schedule,
        lowered: Lowered,
        optimizer: optax.GradientTransformation | None,
        examples: tuple[Any, Any, Any],
    ):
        self.schedule = schedule
        self.optimizer = optimizer
        self.topology = lowered.topo
        self._low = lowered
        self._examples = examples
        topo = lowered.topo
        self._positions = topo.positions
        self._first_holder = np.array([topo.holders(p)[0] for p in range(schedule.stages)])
        self._opt_spec = (
            FlatSpec([jax.eval_shape(optimizer.init, a) for a in lowered.st.param_avals])
            if optimizer is not None
            else None
        )
        self._vg = jax.jit(self._value_and_grad)
        self._train = jax.jit(self._train_step) if optimizer is not None else None
        self._compiled_train = None
        # The training state between steps: each device's rows of its own stages.
        self.layout: DeviceLayout | None = None
        if optimizer is not None:
            self.layout = DeviceLayout(
                topo, lowered.held, lowered.param_spec, self._opt_spec, optimizer
            )
        # The device-layout step, consuming its state buffers (donate) or not.
        self._device_steps = {
            donate: jax.jit(self._train_buffers, donate_argnums=(0, 1) if donate else ())
            for donate in (True, False)
        }
        self._compiled_device: dict[bool, Any] = {}
        self._compiled_vg = None

    @property
    def mesh(self) -> Mesh:
        """The mesh the program runs on (the survivors' one-axis mesh after failures)."""
        return self.topology.mesh

    # ---- host layout <-> device layout (traced inside jit) ----

    def _pack(self, spec: FlatSpec, trees: Sequence[Any]) -> Buffers:
        """Per-stage trees -> (devices, v, L) buffers: each live worker's held chunks."""
        held = self._low.held
        rows = [[spec.pack(s, trees[s]) for s in chunks] for chunks in held]
        by_position = {
            k: jnp.stack([jnp.stack([r[k] for r in pr]) for pr in rows]) for k in spec.sizes
        }
        return {k: b[self._positions] for k, b in by_position.items()}

    def _unpack(self, spec: FlatSpec, bufs: Buffers) -> list[Any]:
        """(devices, v, L) buffers -> per-stage trees, read from each position's first holder."""
        sched = self.schedule
        return [
            spec.unpack(
                s,
                {
                    k: b[self._first_holder[sched.layout[s]], sched.chunk_of(s)]
                    for k, b in bufs.items()
                },
            )
            for s in range(sched.num_virtual_stages)
        ]

    def _device_batch(self, x: Any, plan: TickPlan) -> Any:
        """Batch -> (devices, L, rows, ...): each device's own microbatch list.

        `x` has a leading iterations axis when the program runs several."""
        D, m = self.schedule.replicas, self.schedule.microbatches
        it, r, j = (plan.inputs[..., i] for i in range(3))

        def split(a):
            if self._low.iterations == 1:
                a = a[None]
            return a.reshape(a.shape[0], D, m, a.shape[1] // (D * m), *a.shape[2:])[it, r, j]

        return jax.tree.map(split, x)

    def _shard_map(self, body: Callable, n_in_bufs: int, out_specs: Any, n_replicated: int = 0):
        """body over the program's mesh: `n_in_bufs` buffers and the four
        `_device_args` per device, then `n_replicated` arrays every device sees whole."""
        spec = self.topology.spec
        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(spec,) * (n_in_bufs + 4) + (PS(),) * n_replicated,
            out_specs=out_specs,
            check_vma=False,
        )

    def _device_args(self, x, y, plan: TickPlan):
        """Per-device inputs after the buffers: batch, labels, tick rows, positions."""
        return (
            self._device_batch(x, plan),
            self._device_batch(y, plan),
            jnp.asarray(plan.rows),
            jnp.asarray(self._positions),
        )

    @staticmethod
    def _local(*trees):
        return tuple(jax.tree.map(lambda a: a[0], t) for t in trees)

    def _value_and_grad(self, stage_params, x, y):
        low = self._low

        def body(params, x, y, rows, pos):
            params, x, y, rows, _ = self._local(params, x, y, rows, pos)
            loss, grads = low.tick_loop(params, x, y, rows, with_aux=low.loss.has_aux)
            return loss, {k: g[None] for k, g in grads.items()}

        f = self._shard_map(body, 1, (PS(), self.topology.spec))
        loss, grads = f(
            self._pack(low.param_spec, stage_params), *self._device_args(x, y, low.plan)
        )
        return loss, self._unpack(low.param_spec, grads)

    def _train_buffers(self, params: Buffers, opt: Buffers, x, y):
        """The training step on the device layout: (params, opt) buffers of shape
        (devices, v, L) in, the updated buffers and the loss out."""
        low, spec = self._low, self._opt_spec
        plan = low.step_plan if low.stepping else low.plan

        def body(params, opt, x, y, rows, pos, *updates):
            params, opt, x, y, rows, pos = self._local(params, opt, x, y, rows, pos)
            if low.stepping:
                params, opt, loss = low.stepping_loop(
                    self.optimizer, spec, params, opt, x, y, rows, *updates, pos
                )
            else:
                loss, grads = low.tick_loop(params, x, y, rows)
                params, opt = low.optimizer_step(self.optimizer, spec, params, grads, opt, pos)
            return (
                {k: b[None] for k, b in params.items()},
                {k: b[None] for k, b in opt.items()},
                loss,
            )

        out = self.topology.spec
        updates = (jnp.asarray(plan.updates),) if low.stepping else ()
        f = self._shard_map(body, 2, (out, out, PS()), n_replicated=len(updates))
        params, opt, loss = f(params, opt, *self._device_args(x, y, plan), *updates)
        if low.stepping and low.iterations == 1:
            loss = loss[0]
        return params, opt, loss

    def _train_step(self, stage_params, opt_state, x, y):
        low, spec = self._low, self._opt_spec
        params, opt, loss = self._train_buffers(
            self._pack(low.param_spec, stage_params), self._pack(spec, opt_state), x, y
        )
        return self._unpack(low.param_spec, params), self._unpack(spec, opt), loss

    # ---- public API ----

    def _with_keys(self, x: Any, rngs: Any) -> Any:
        """The batch with each microbatch's key data next to it, when lowered with rngs."""
        impls = self._low.rng_impls
        if (rngs is None) != (impls is None):
            raise ValueError(
                "rngs: this pipeline was lowered "
                + ("with rngs: pass rngs=" if impls else "without rngs: lower(..., rngs=) first, ")
                + f"a dict like {{'dropout': jax.random.key(0)}} (streams {sorted(impls or {})})"
            )
        if rngs is None:
            return x
        rngs = check_rngs(rngs)
        if sorted(rngs) != sorted(impls):
            raise ValueError(f"rngs: expected the streams {sorted(impls)}, got {sorted(rngs)}")
        count = self.schedule.replicas * self.schedule.microbatches
        return x, microbatch_key_data(rngs, count, self._low.iterations)

    def value_and_grad(
        self, stage_params: Sequence[Any], x: Any, y: Any, rngs: Any = None
    ) -> tuple[jax.Array, list]:
        """(loss over the global batch, per-stage parameter gradients); the loss is
        (loss, aux) when lowered with has_aux=True (see loss.py). `rngs`: when
        lowered with rngs, this step's {stream: key} (see rng.py)."""
        return self._vg(list(stage_params), self._with_keys(x, rngs), y)

    def init_opt_state(self, stage_params: Sequence[Any]) -> list[Any]:
        """One optax state per virtual stage (the optimizer runs stage by stage)."""
        if self.optimizer is None:
            raise ValueError("init_opt_state needs lower(..., optimizer=an optax transformation)")
        return [self.optimizer.init(p) for p in stage_params]

    def train_step(
        self,
        stage_params: Sequence[Any],
        opt_state: Sequence[Any],
        x: Any,
        y: Any,
        rngs: Any = None,
    ) -> tuple[list, list, jax.Array]:
        """(new stage params, new opt state, loss before the update).

        Compiled with iterations=N > 1, one call runs N steps: x and y carry a
        leading axis of N batches and the loss is one per step. Staggered
        schedules (and N > 1) step each stage's optimizer inside the loop, as
        soon as its gradients are complete; otherwise all stages step after it.
        """
        if self._train is None:
            raise ValueError("train_step needs lower(..., optimizer=an optax transformation)")
        run = self._compiled_train or self._train
        return run(list(stage_params), list(opt_state), self._with_keys(x, rngs), y)

    def compile_train_step(
        self, stage_params: Sequence[Any], opt_state: Sequence[Any], x: Any, y: Any
    ) -> float:
        """AOT-compile train_step for arguments shaped and placed like these (arrays
        or ShapeDtypeStructs with shardings); later calls run that executable and
        must pass arguments placed the same way. Returns the seconds it took."""
        if self._train is None:
            raise ValueError("train_step needs lower(..., optimizer=an optax transformation)")
        if self._low.rng_impls is not None:
            raise ValueError(
                "compile_train_step: a pipeline lowered with rngs compiles on its first "
                "train_step call instead"
            )
        start = time.perf_counter()
        args = jax.tree.map(_abstract_placed, (list(stage_params), list(opt_state), x, y))
        self._compiled_train = self._train.lower(*args).compile()
        return time.perf_counter() - start

    def device_train_step(
        self,
        params: Buffers,
        opt: Buffers,
        x: Any,
        y: Any,
        donate: bool = True,
        rngs: Any = None,
    ) -> tuple[Buffers, Buffers, jax.Array]:
        """train_step on the device layout (`self.layout`): (params, opt) buffers in
        and out, no per-stage trees. With `donate` the buffers passed in are consumed
        (their memory holds the new state). `rngs` as in `train_step`."""
        if self.layout is None:
            raise ValueError(
                "device_train_step needs lower(..., optimizer=an optax transformation)"
            )
        run = self._compiled_device.get(donate) or self._device_steps[donate]
        return run(params, opt, self._with_keys(x, rngs), y)

    def compile_device_train_step(self, x: Any, y: Any, donate: bool = True) -> float:
        """AOT-compile device_train_step for batches shaped and placed like x and y
        (arrays or ShapeDtypeStructs with shardings); returns the seconds it took."""
        if self.layout is None:
            raise ValueError(
                "device_train_step needs lower(..., optimizer=an optax transformation)"
            )
        if self._low.rng_impls is not None:
            raise ValueError(
                "compile_device_train_step: a pipeline lowered with rngs compiles on its "
                "first device_train_step call instead"
            )
        start = time.perf_counter()
        batch = jax.tree.map(_abstract_placed, (x, y))
        lowered = self._device_steps[donate].lower(*self.layout.avals(), *batch)
        self._compiled_device[donate] = lowered.compile()
        return time.perf_counter() - start

    def async_weight_bytes(self) -> int:
        """Bytes each device holds for the extra weight copies of an asynchronous
        schedule (predict: the last update; stash: one version per residual slot);
        0 for a synchronous one."""
        low = self._low
        if low.weights is None:
            return 0
        return low.weights.extra_bytes(low.param_spec, (low.step_plan or low.plan).res_slots)

    def memory_analysis(self) -> Any:
        """XLA's memory analysis of the compiled value_and_grad program."""
        if self._compiled_vg is None:
            self._compiled_vg = self._vg.lower(*self._examples).compile()
        return self._compiled_vg.memory_analysis()


def _abstract_placed(a: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a), sharding=a.sharding)


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


def _check(schedule: Schedule, stage_fns, mesh: Mesh, stage_params, x, y) -> None:
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a pjit_pipe Schedule, got {type(schedule).__name__}")
    validate(schedule)
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes must be {AXES}, got {tuple(mesh.axis_names)}")
    shape = (mesh.shape["data"], mesh.shape["stage"])
    if shape != (schedule.replicas, schedule.stages):
        raise ValueError(
            f"mesh (data, stage) = {shape} does not match the schedule's "
            f"(replicas, stages) = {(schedule.replicas, schedule.stages)}"
        )
    S = schedule.num_virtual_stages
    if len(stage_fns) != S or len(stage_params) != S:
        raise ValueError(
            f"stage_fns and stage_params need one entry per virtual stage (stages*chunks = {S}), "
            f"got {len(stage_fns)} and {len(stage_params)}"
        )
    lead = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves((x, y))}
    n = schedule.replicas * schedule.microbatches
    if len(lead) != 1 or None in lead:
        raise ValueError(f"x and y leaves must share one leading batch dimension, got {lead}")
    (batch,) = lead
    if batch % n:
        raise ValueError(f"global batch {batch} is not divisible by replicas*microbatches = {n}")


def lower(
    schedule: Schedule,
    stage_fns: Sequence[Callable],
    loss_fn: Callable,
    mesh: Mesh,
    stage_params: Sequence[Any],
    x: Any,
    y: Any,
    optimizer: optax.GradientTransformation | None = None,
    remat: bool = False,
    iterations: int = 1,
    has_aux: bool = False,
    rngs: Any = None,
    shared: Mapping[str, Sequence[int]] | None = None,
    split_backward: bool = True,
    async_weights: str | None = None,
    staleness_offset: int = 0,
) -> PipelineStep:
    """Compile `schedule` for these stages into one SPMD program per entry point.

    `mesh` is the whole (data, stage) mesh; when the schedule has failed
    workers the program runs on the survivors' devices only.

    stage_fns[s](params_s, act) -> act for each of the P*v virtual stages;
    loss_fn(out, y_mb) -> the mean loss of one microbatch, or (loss_sum, weight)
    (masked/weighted losses: the loss is sum(loss_sum) / sum(weight) over the
    global batch), or with has_aux=True (either of those, aux) where aux is a
    pytree of metrics, averaged over microbatches (see loss.py). stage_params, x
    and y are examples (shapes only). With remat=True, B and W recompute the
    stage forward instead of reading stored vjp residuals. With iterations=N,
    train_step runs N back-to-back training iterations per call (x and y are
    then examples of one iteration's batch). `rngs` is an example {stream name:
    key} for stage functions that draw random numbers (dropout): each step then
    takes its own rngs, and a stage function reads its microbatch's keys with
    `rng.current_rngs()` (see rng.py). `shared` maps a key of the stage
    parameter dicts to the virtual stages that each hold a copy of it (tied
    weights): their gradients are summed, so the copies stay equal. split_backward=False
    makes W re-run the whole stage pullback (the old split, kept for comparisons);
    the split backward is also off with remat (B and W recompute) and with rngs
    (its stage jaxpr is traced once, so it would fix one microbatch's keys).
    An asynchronous schedule (async-1f1b) takes `async_weights` "predict"
    (default), "stash" or "latest" and `staleness_offset` (see async_weights.py);
    its train_step then runs iterations*m optimizer steps, one per microbatch.
    """
    _check(schedule, stage_fns, mesh, stage_params, x, y)
    check_shared(shared or {}, stage_params)
    n = schedule.replicas * schedule.microbatches
    mb = lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // n, *np.shape(a)[1:]), jnp.result_type(a))  # noqa: E731
    # Stages run as separate B and W get the split backward (see the docstring).
    split = {op.stage for _, _, op in schedule.ops() if op.kind in (Kind.B, Kind.W)}
    if remat or not split_backward or rngs is not None:
        split = set()
    loss = LossLayout(loss_fn, has_aux)
    impls, example_keys = None, {}
    if rngs is not None:
        typed = check_rngs(rngs)
        impls, example_keys = impls_of(typed), {k: jax.random.key_data(v) for k, v in typed.items()}
    with microbatch_rngs(example_keys, impls) if impls else contextlib.nullcontext():
        stages = StageVjp(
            stage_fns,
            loss.vector,
            _abstract(list(stage_params)),
            jax.tree.map(mb, x),
            jax.tree.map(mb, y),
            split,
        )
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
    topology = Topology.of(mesh, schedule.failed)
    weights = async_weights_for(
        schedule, async_weights, optimizer, stages.param_avals, remat, loss, staleness_offset
    )
    lowered = Lowered(
        schedule,
        stages,
        topology,
        remat,
        iterations,
        shared,
        loss=loss,
        rng_impls=impls,
        weights=weights,
    )
    stepping = optimizer is not None and lowered.stepping
    if stepping and count_norm_calls(optimizer, *lowered._stage0_avals(optimizer)):
        raise ValueError(
            "optimizer: it takes a norm of the whole update tree (optax.clip_by_global_norm "
            "or another optax.tree.norm / optax.global_norm user), which needs every "
            "stage's gradients before any stage steps; a staggered schedule or "
            "iterations > 1 steps stages at different times. Use an unstaggered "
            "schedule with iterations=1, or a per-parameter clip (optax.clip)"
        )
    examples = (_abstract(list(stage_params)), _abstract(x), _abstract(y))
    return PipelineStep(schedule, lowered, optimizer, examples)
