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

import functools
import time
from collections.abc import Callable, Sequence
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
    ):
        self.sched = schedule
        self.st = stages
        self.topo = topology
        self.iterations = iterations
        self.plan: TickPlan = build_plan(schedule, remat, topology.workers)
        # Staggered or multi-iteration training runs the optimizer inside the loop.
        self.stepping = schedule.staggered or iterations > 1
        self.step_plan: TickPlan | None = None
        if self.stepping:
            self.step_plan = (
                self.plan
                if iterations == 1
                else build_plan(schedule, remat, topology.workers, iterations)
            )
        self.remat = remat
        self.param_spec = FlatSpec(stages.param_avals)
        boundaries = stages.act_avals[1:]
        leaves = jax.tree.leaves(boundaries)
        msg_dtype = jnp.result_type(*leaves) if leaves else jnp.float32
        if not jnp.issubdtype(msg_dtype, jnp.floating):
            raise ValueError(
                f"activations between stages must be floating point, got {msg_dtype} "
                "(only stage 0 may take integer inputs)"
            )
        self.msg_spec = FlatSpec(boundaries, dtype=msg_dtype)
        self.msg_key = np.dtype(msg_dtype).name
        self.scale = 1.0 / (schedule.replicas * schedule.microbatches)
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
            return self.msg_spec.unpack(s - 1, {self.msg_key: msgs[row[IN_SLOT]]})

        def run(params, x, y, msgs, res, row):
            msg = jnp.zeros((self.msg_spec.sizes[self.msg_key],), self.msg_key)
            p = params[c] if self.uniform[c] else self.param_spec.unpack(s, params[c])
            y_mb = jax.tree.map(lambda a: a[row[MB]], y) if s == S - 1 else None
            if kind is Kind.F:
                a = stage_input(x, msgs, row)
                if self.remat:
                    out, res_out = st.forward(s, p, a, y_mb), {}
                else:
                    out, res_out = st.forward_with_residuals(s, p, a, y_mb)
                if s == S - 1:
                    return msg, res_out, out.astype(jnp.float32) * self.scale
                return self.msg_spec.pack(s, out)[self.msg_key], res_out, jnp.zeros((), jnp.float32)
            if s == S - 1:
                g = jnp.asarray(self.scale, st.loss_aval.dtype)
            else:
                g = self.msg_spec.unpack(s, {self.msg_key: msgs[row[G_SLOT]]})
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
                msg = self.msg_spec.pack(s - 1, dinput)[self.msg_key]
            if kind is Kind.B:
                return msg, put, jnp.zeros((), jnp.float32)
            # A uniform chunk's gradient stays a tree (see `_zero_grads`).
            dpar = dparams if self.uniform[c] else self.param_spec.pack(s, dparams)
            return msg, dpar, jnp.zeros((), jnp.float32)

        return run

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
            jnp.zeros((K + 1, self.msg_spec.sizes[self.msg_key]), self.msg_key),
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

    def _tick(self, plan: TickPlan, params, x, y, msgs, res, grads, row):
        """One tick: this device's op (if any), then every ppermute of the plan."""
        msg = jnp.zeros((self.msg_spec.sizes[self.msg_key],), self.msg_key)
        loss = jnp.zeros((), jnp.float32)
        args = (params, x, y, msgs)

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
                msg, put, _ = dispatch(self.input_grads, *args, res, row)
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
                msg, dpar, _ = dispatch(group, *args, res, row)
                return msg, jax.tree.map(jnp.add, acc, dpar)

            msg, grads[c] = lax.cond(taken(group), weight_grad, lambda *a: a, msg, grads[c])
        msgs = msgs.at[row[SELF_SLOT]].set(msg)
        for i, (_, pairs) in enumerate(plan.shifts):
            got = lax.ppermute(msg, self.topo.axes, perm=pairs)
            msgs = msgs.at[row[RECV0 + i]].set(got)
        return msgs, res, grads, loss

    def tick_loop(self, params: Buffers, x: Any, y: Any, rows: jax.Array):
        """Run every tick on this device; return (summed loss share, local gradient rows)."""
        params = self.chunk_params(params)

        def tick(carry, row):
            *state, loss = carry
            *state, dloss = self._tick(self.plan, params, x, y, *state, row)
            return (*state, loss + dloss), None

        (_, _, grads, loss), _ = lax.scan(
            tick, (*self._empty(self.plan), jnp.zeros((), jnp.float32)), rows
        )
        grads = self.topo.reduce_over_replicas(self._flat_grads(grads))
        return lax.psum(loss, self.topo.axes), grads

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
        """
        plan, v = self.step_plan, self.sched.chunks
        msgs, res, grads = self._empty(plan)
        losses = jnp.zeros((self.iterations,), jnp.float32)

        def step(row, state):
            grads, params, opt = state
            mine = ((row[UPDATE] >> jnp.arange(v)) & 1).astype(bool)[:, None]
            g = {k: jnp.where(mine, b, 0) for k, b in self._flat_grads(grads).items()}
            g = self.topo.reduce_over_replicas(g)
            new_p, new_o = self.optimizer_step(optimizer, opt_spec, params, g, opt, pos)
            params = {k: jnp.where(mine, new_p[k], b) for k, b in params.items()}
            opt = {k: jnp.where(mine, new_o[k], b) for k, b in opt.items()}
            grads = [
                jax.tree.map(lambda a, m=mine[c, 0]: jnp.where(m, 0, a), g)
                for c, g in enumerate(grads)
            ]
            return grads, params, opt

        def tick(carry, inputs):
            row, update = inputs
            msgs, res, grads, losses, params, opt = carry
            chunks = self.chunk_params(params)
            msgs, res, grads, dloss = self._tick(plan, chunks, x, y, msgs, res, grads, row)
            losses = losses.at[row[ITER]].add(dloss)
            grads, params, opt = lax.cond(
                update, functools.partial(step, row), lambda s: s, (grads, params, opt)
            )
            return (msgs, res, grads, losses, params, opt), None

        carry = (msgs, res, grads, losses, params, opt)
        (*_, losses, params, opt), _ = lax.scan(tick, carry, (rows, updates))
        return params, opt, lax.psum(losses, self.topo.axes)

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
        """
        new_p = {k: [] for k in params}
        new_o = {k: [] for k in opt}
        for c in range(self.sched.chunks):
            stages_c = [self.held[p][c] for p in range(self.sched.stages)]

            def update(s, c=c):
                def run():
                    p = self.param_spec.unpack(s, {k: b[c] for k, b in params.items()})
                    g = self.param_spec.unpack(s, {k: b[c] for k, b in grads.items()})
                    o = opt_spec.unpack(s, {k: b[c] for k, b in opt.items()})
                    upd, o = optimizer.update(g, o, p)
                    return self.param_spec.pack(s, optax.apply_updates(p, upd)), opt_spec.pack(s, o)

                return run

            which = jnp.asarray(np.argsort(np.argsort(stages_c)), jnp.int32)[pos]
            p_c, o_c = lax.switch(which, [update(s) for s in sorted(stages_c)])
            for k in new_p:
                new_p[k].append(p_c[k])
            for k in new_o:
                new_o[k].append(o_c[k])
        return {k: jnp.stack(b) for k, b in new_p.items()}, {
            k: jnp.stack(b) for k, b in new_o.items()
        }


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
            loss, grads = low.tick_loop(params, x, y, rows)
            return loss, {k: g[None] for k, g in grads.items()}

        f = self._shard_map(body, 1, (PS(), self.topology.spec))
        loss, grads = f(
            self._pack(low.param_spec, stage_params), *self._device_args(x, y, low.plan)
        )
        return loss, self._unpack(low.param_spec, grads)

    def _train_step(self, stage_params, opt_state, x, y):
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
        params, opt, loss = f(
            self._pack(low.param_spec, stage_params),
            self._pack(spec, opt_state),
            *self._device_args(x, y, plan),
            *updates,
        )
        if low.stepping and low.iterations == 1:
            loss = loss[0]
        return self._unpack(low.param_spec, params), self._unpack(spec, opt), loss

    # ---- public API ----

    def value_and_grad(self, stage_params: Sequence[Any], x: Any, y: Any) -> tuple[jax.Array, list]:
        """(mean loss over the global batch, per-stage parameter gradients)."""
        return self._vg(list(stage_params), x, y)

    def init_opt_state(self, stage_params: Sequence[Any]) -> list[Any]:
        """One optax state per virtual stage (the optimizer runs stage by stage)."""
        if self.optimizer is None:
            raise ValueError("init_opt_state needs lower(..., optimizer=an optax transformation)")
        return [self.optimizer.init(p) for p in stage_params]

    def train_step(
        self, stage_params: Sequence[Any], opt_state: Sequence[Any], x: Any, y: Any
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
        return run(list(stage_params), list(opt_state), x, y)

    def compile_train_step(
        self, stage_params: Sequence[Any], opt_state: Sequence[Any], x: Any, y: Any
    ) -> float:
        """AOT-compile train_step for arguments shaped and placed like these (arrays
        or ShapeDtypeStructs with shardings); later calls run that executable and
        must pass arguments placed the same way. Returns the seconds it took."""
        if self._train is None:
            raise ValueError("train_step needs lower(..., optimizer=an optax transformation)")
        start = time.perf_counter()
        args = jax.tree.map(_abstract_placed, (list(stage_params), list(opt_state), x, y))
        self._compiled_train = self._train.lower(*args).compile()
        return time.perf_counter() - start

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
    split_backward: bool = True,
) -> PipelineStep:
    """Compile `schedule` for these stages into one SPMD program per entry point.

    `mesh` is the whole (data, stage) mesh; when the schedule has failed
    workers the program runs on the survivors' devices only.

    stage_fns[s](params_s, act) -> act for each of the P*v virtual stages;
    loss_fn(out, y_mb) -> scalar mean loss of one microbatch. stage_params, x
    and y are examples (shapes only). With remat=True, B and W recompute the
    stage forward instead of reading stored vjp residuals. With iterations=N,
    train_step runs N back-to-back training iterations per call (x and y are
    then examples of one iteration's batch). split_backward=False makes W
    re-run the whole stage pullback (the old split, kept for comparisons).
    """
    _check(schedule, stage_fns, mesh, stage_params, x, y)
    n = schedule.replicas * schedule.microbatches
    mb = lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // n, *np.shape(a)[1:]), jnp.result_type(a))  # noqa: E731
    # Stages run as separate B and W get the split backward (remat recomputes instead).
    split = {op.stage for _, _, op in schedule.ops() if op.kind in (Kind.B, Kind.W)}
    if remat or not split_backward:
        split = set()
    stages = StageVjp(
        stage_fns,
        loss_fn,
        _abstract(list(stage_params)),
        jax.tree.map(mb, x),
        jax.tree.map(mb, y),
        split,
    )
    if not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
    lowered = Lowered(schedule, stages, Topology.of(mesh, schedule.failed), remat, iterations)
    examples = (_abstract(list(stage_params)), _abstract(x), _abstract(y))
    return PipelineStep(schedule, lowered, optimizer, examples)
