"""The tick body and the tick loop: what every device runs, tick by tick.

Every device scans over the rows of its own tick table (plan.py). In each
tick it reads the message rows its lanes need, runs up to one op per lane (two
W's in the W lane) in the table's lane order, F, B, W/BW or B, W/BW, F
(ir/ticks.py; each group of ops of tick_ops.py is its own two-way `lax.cond`,
and a second W has conds of its own, in plans whose table has one; a loss-stage
F and backward that share a tick run as one op in the W lane, plan.FUSED), then the
ppermutes of the two message channels run (delivery.py; a deferred plan runs
its late channel's at the start of the next tick) and the received messages
are stored in the slots the row names. After
the loop the parameter gradients are summed over the live replicas of each
stage.

Carried through the loop (shapes per device; dtype-keyed dicts of arrays):
- message store: (K + 1, message size) per dtype, the activations and
  gradients received and not yet read; slot K is scratch (no message); a
  deferred plan's has one more row, its outbox (`TickPlan.outbox`): the late
  message this device made in the tick before, sent at the start of the next;
- residual stores (`stages.Residuals`): the B-pool, (RB, row size) per
  dtype, a split stage's vjp residuals from its F to its B; the W-pool,
  (R, row size) per dtype, a split stage's W operands (from F) and site
  cotangents (from B), any other stage's vjp residuals, until the stage's
  W/BW; both empty with remat;
- gradient accumulators: per chunk, the chunk's parameter tree (or one flat
  (L,) row when the positions' stages differ in shape), summed over W/BW; with
  ZeRO's `grad_sum="slices"` this replica's (L/D,) slices of the chunk's rows;
- loss: (loss vector size,), the sum of this device's last-stage loss shares.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule, ScheduleError
from pjit_pipe.ir.ticks import PackedTicks, late_channel
from pjit_pipe.lowering.async_pipeline.async_weights import AsyncWeights
from pjit_pipe.lowering.comms.delivery import Post
from pjit_pipe.lowering.comms.messages import MessageSpec, read_rows
from pjit_pipe.lowering.comms.topology import Topology
from pjit_pipe.lowering.compute.compute_dtype import compute_param_spec
from pjit_pipe.lowering.compute.data_order import after
from pjit_pipe.lowering.compute.emulated_ticks import EmulatedTicks, EmulationHost
from pjit_pipe.lowering.compute.loss import LossLayout
from pjit_pipe.lowering.compute.stages import Residuals, StageVjp
from pjit_pipe.lowering.compute.tick_ops import Inbox, OpGroup, StageOps
from pjit_pipe.lowering.layout.flat_buffers import Buffers
from pjit_pipe.lowering.layout.param_layout import ChunkLayout
from pjit_pipe.lowering.layout.shared import SharedGrads
from pjit_pipe.lowering.layout.tensor_layout import LeafSplits
from pjit_pipe.lowering.layout.zero import ZeroLayout
from pjit_pipe.lowering.tick_plan import FUSED, OpRow, TickPlan, TickRow, build_plan

# Whether XLA updates a buffer in place in a multi-way conditional's branches: the
# XLA of jaxlib 0.10 copies it on every execution, 0.11 and later do not.
SWITCH_UPDATES_IN_PLACE = jax.__version_info__ >= (0, 11)


class TickProgram:
    """The traced pieces of one (schedule, model, shapes): the tick plans, the op
    functions, the carried buffers and the device body of the tick loop."""

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
        ticks: PackedTicks | None = None,
        weights: AsyncWeights | None = None,
        emulate: EmulationHost | None = None,
        pairwise: bool = False,
        splits: Sequence[LeafSplits] | None = None,
        row_multiple: int = 1,
    ):
        self.sched, self.st = schedule, stages
        self.loss = loss  # what the last stage's loss vector holds (stages.loss_fn = loss.vector)
        # Stream name -> key impl when steps take rngs (the batch is then (x, key data)).
        self.rng_impls = rng_impls
        self.weights = weights  # an asynchronous schedule's weight policy (async_weights.py)
        self.topo = topology
        self.iterations = iterations
        keyed = rng_impls is not None  # every op reads its microbatch's keys
        if ticks is None:
            ticks = PackedTicks.one_op_per_tick(schedule, iterations)
        elif ticks.schedule != schedule or ticks.iterations != iterations:
            raise ScheduleError(
                f"ticks: a table of {ticks.iterations} iteration(s) of schedule "
                f"{ticks.schedule.kind!r} was given to lower {iterations} iteration(s) of "
                f"{schedule.kind!r}; pack_ticks(schedule, costs, iterations={iterations})"
            )
        self.ticks = ticks  # the table this program runs (its iteration 0 for value_and_grad)
        # The loss stage's F and backward of a microbatch that share a tick run as one
        # op (plan.FUSED), unless a weight policy gives them different weights.
        plan = functools.partial(
            build_plan,
            remat=remat,
            devices=topology.workers,
            every_stage_reads=keyed,
            split=stages.split,
            fuse_loss=weights is None,
            pairwise=pairwise,
        )
        # With several iterations, the plan of the first (value_and_grad) numbers its
        # ops as the whole table's plan does: the two share their op functions.
        every = plan(ticks) if iterations > 1 else None
        self.plan: TickPlan = (
            plan(ticks.first_iteration(), numbering=every.branches) if every else plan(ticks)
        )
        # Staggered or multi-iteration training runs the optimizer inside the loop.
        self.stepping = schedule.staggered or iterations > 1
        self.step_plan: TickPlan | None = (every or self.plan) if self.stepping else None
        self.remat = remat
        self.fused = (FUSED, stages.S - 1) in self.plan.branches
        # Leaves split over 'tensor' get shaped buffers of their own (packing.py).
        self.splits = splits
        # `row_multiple`: ZeRO cuts each flat row into D slices (zero.py).
        avals, dtypes = stages.param_avals, stages.compute_dtypes
        self.param_spec = compute_param_spec(avals, splits, row_multiple, dtypes)
        self.msg_spec = MessageSpec(stages.act_avals[1:])
        self.post = Post(self.msg_spec, topology.axes)
        self.held = [schedule.held_stages(p) for p in range(schedule.stages)]
        # An emulated run's hooks (emulated_ticks.py): op stubs and tick callbacks.
        self.emulate = EmulatedTicks(emulate, topology.axes) if emulate else None
        self.shared = None
        if shared:
            self.shared = SharedGrads(
                shared, self.param_spec, self.held, topology.positions, topology.axes
            )
        # Per chunk, how the loop holds its parameters and gradient (param_layout.py):
        # size classes, or flat rows where a weight policy picks the weights anew
        # on every tick (asynchronous weights).
        self.layouts = [
            ChunkLayout(self.param_spec, chunk, classes=weights is None)
            for chunk in zip(*self.held, strict=True)
        ]
        self.ops = StageOps(
            schedule,
            stages,
            self.plan.branches,
            self.msg_spec,
            self.layouts,
            remat,
            loss,
            rng_impls,
            stub=self.emulate.op if self.emulate else None,
        )

    # ---- the carried buffers ----

    def chunk_params(self, params: Buffers, pos: jax.Array) -> list[Any]:
        """Per chunk: its parameters as the loop holds them (see param_layout.py),
        from this device's (v, L) rows; `pos` is its pipeline position."""
        return [
            layout.enter({k: b[c] for k, b in params.items()}, pos)
            for c, layout in enumerate(self.layouts)
        ]

    def empty(self, plan: TickPlan) -> tuple[Buffers, Residuals, list[Any]]:
        """(message store with its scratch slot, residual stores, gradient accumulators)."""
        R, RB = plan.res_slots, plan.bres_slots
        return (
            self.msg_spec.zeros(plan.store_rows),
            Residuals({}, {})
            if self.remat
            else Residuals(self.st.b_spec.zeros(RB), self.st.w_spec.zeros(R)),
            self.zero_grads(),
        )

    def zero_grads(self) -> list[Any]:
        """Per chunk, the gradient accumulator, in the chunk's layout: W adds to it
        buffer by buffer."""
        return [layout.zeros() for layout in self.layouts]

    def flat_grads(self, grads: list[Any], pos: jax.Array) -> Buffers:
        """Per-chunk accumulators -> the (v, L) gradient rows of the device layout."""
        # One concatenate of every chunk's pieces: neither a stack (XLA copies each
        # row of it) nor a concatenate of packed rows (a second row-long pass).
        rows = [layout.leave_pieces(g, pos) for layout, g in zip(self.layouts, grads, strict=True)]
        join = lambda k: jnp.concatenate([jnp.ravel(p) for r in rows for p in r[k]])  # noqa: E731
        return {k: join(k).reshape(len(rows), *self.param_spec.shapes[k]) for k in rows[0]}

    # ---- one tick ----
    #
    # Each lane runs its op, if any, in groups of ops that write the same buffers
    # (tick_ops.py), each group one two-way `lax.cond`: branch 0 passes the carried
    # stores through (the idle case), branch 1 runs the op the row names (a switch
    # over the group's ops when it has several). W and BW return their gradient,
    # added into the accumulator in place after the switch; F and B write their
    # residual leaves into the stores in place inside it (`lane`'s `updates`).
    # The message store is no operand of any cond: each lane's message rows are read
    # before the first op, so the store's writes after the last op update it in
    # place too (a cond that read the store would make XLA copy it twice per tick).

    def inboxes(self, plan: TickPlan, msgs: Buffers, row: TickRow, second_w: bool):
        """(the F, B and W lanes' message rows, and the second W's when the plan has
        one; a deferred plan's late arrivals, else None). Activations (`in_slot`)
        and gradients (`g_slot`) are read in one gather, a deferred plan's outbox
        row too: its late messages of the tick before then travel while the first
        lane runs (it reads only the other channel), and the late channel's reads
        see them (`delivery.Arrived.read_through`). Every write of the store
        (`Post.end_of_tick`) follows that one read: in place."""
        none = self.msg_spec.zeros()
        reads = [row.b, row.w, row.w2] if second_w else [row.b, row.w]
        n = len(reads)
        act_slots = [row.f.in_slot]
        if self.remat:  # B, W and BW re-run the stage's forward on their input
            act_slots += [r.in_slot for r in reads]
        elif self.fused:  # a fused F and backward in the W lane reads its input
            act_slots.append(row.w.in_slot)
        grad_slots = [r.g_slot for r in reads]
        outbox = [plan.outbox] if plan.deferred else []
        got = read_rows(msgs, act_slots + grad_slots + outbox)
        acts = got[: len(act_slots)]
        grads = got[len(act_slots) : len(act_slots) + len(grad_slots)]
        late = None
        if plan.deferred:
            late = self.post.start_of_tick(plan, row, got[-1])
            if late_channel(plan.order) is Kind.F:
                acts = [late.read_through(s, a) for s, a in zip(act_slots, acts, strict=True)]
            else:
                grads = [late.read_through(s, g) for s, g in zip(grad_slots, grads, strict=True)]
        if self.emulate:  # every lane runs after the tick's start callback
            acts, grads = self.emulate.tick_start((acts, grads))
        if self.remat:
            lane_acts = acts[1:]
        else:
            lane_acts = [none] * n
            if self.fused:
                lane_acts[1] = acts[-1]
        inboxes = [
            Inbox(acts[0], none),
            *(Inbox(a, g) for a, g in zip(lane_acts, grads, strict=True)),
        ]
        return inboxes, late

    def lane(self, group: OpGroup, lane: OpRow, run: Callable, *carry, updates: bool = False):
        """`run(op, *carry)` for the op of `group` that the lane's branch names, else
        `carry` unchanged: a two-way cond (branch 0 passes the carry through) of a
        switch over the group's ops. With `updates` (the ops write a carried store
        in place), a chain of two-way conds where a switch would copy the store."""
        ids, fns = group
        pick = np.zeros(len(self.plan.branches) + 1, np.int32)  # branch id -> 1 + op index
        pick[ids] = np.arange(1, len(ids) + 1)
        which = jnp.asarray(pick)[lane.branch]
        if len(fns) == 1:
            op = fns[0]
        elif updates and not SWITCH_UPDATES_IN_PLACE:
            for i, fn in enumerate(fns, 1):
                carry = lax.cond(which == i, functools.partial(run, fn), lambda *c: c, *carry)
            return carry
        else:

            def op(*operands):
                return lax.switch(which - 1, fns, *operands)

        return lax.cond(which > 0, functools.partial(run, op), lambda *c: c, *carry)

    def tick(self, plan, params, x, y, msgs, res, grads, row, back_params=None, add_grad=None):
        """One tick: this device's F, B and W lanes in the table's lane order (ir/ticks.py),
        then every ppermute of the plan. B and W read `back_params` when given
        (asynchronous weights), else `params`. `add_grad(c, acc, dpar)` sums a W's
        gradient into chunk c's accumulator (default: added leaf by leaf)."""
        ops = self.ops
        act = self.msg_spec.zeros()  # the activation this tick sends (F)
        grad = self.msg_spec.zeros()  # the input gradient this tick sends (B or BW)
        loss = ops.no_loss()
        grads = list(grads)
        back = params if back_params is None else back_params
        # The W lane runs a second W only in plans whose table has one (ir/ticks.py).
        second_w = bool(np.any(plan.rows.w2.branch))
        (f_in, b_in, *w_ins), late = self.inboxes(plan, msgs, row, second_w)

        def forward_lane() -> None:
            nonlocal act, res, loss
            if not ops.forwards[0]:
                return
            res_w, bres_w = row.f.res_w, row.f.bres_w
            if plan.order[-1] is Kind.F:  # F writes slots the tick's B, W, BW read
                res_w, bres_w = (after(grad, slot) for slot in (res_w, bres_w))

            def forward(op, act, res, loss):  # F writes its rows into the stores in place
                return op(params, x, y, f_in, res, row.f._replace(res_w=res_w, bres_w=bres_w))

            act, res, loss = self.lane(ops.forwards, row.f, forward, act, res, loss, updates=True)

        def input_grad_lane() -> None:
            nonlocal grad, res
            if not ops.input_grads[0]:
                return

            def input_grad(op, grad, res):  # B writes its cotangents into the W-pool in place
                grad, res, _ = op(back, x, y, b_in, res, row.b)
                return grad, res

            grad, res = self.lane(ops.input_grads, row.b, input_grad, grad, res, updates=True)

        def weight_grad_lane() -> None:
            nonlocal grad, loss
            lanes = [(ops.weight_grads, row.w, w_ins[0])]
            if second_w:  # its own conds, of the W branches alone
                lanes.append((ops.second_weight_grads, row.w2, w_ins[1]))
            for groups, lane_row, inbox in lanes:
                for c, group in enumerate(groups):
                    if not group[0]:
                        continue

                    def weight_grad(op, grad, acc, *loss, lane_row=lane_row, inbox=inbox, c=c):
                        # A W sends nothing (its message is zeros); a BW's (or a fused
                        # group's) tick has no B (the lane rule), so the gradient channel
                        # holds one of them: their sum. (Through it, a B, W, F tick's F
                        # writes after them.) Only a fused group has a loss share: the
                        # loss is carried through the groups that hold one.
                        msg, dpar, share = op(back, x, y, inbox, res, lane_row)
                        grad = jax.tree.map(jnp.add, grad, msg)
                        acc = (
                            add_grad(c, acc, dpar) if add_grad else jax.tree.map(jnp.add, acc, dpar)
                        )
                        return (grad, acc, loss[0] + share) if loss else (grad, acc)

                    carry = [grad, grads[c]]
                    if any(self.plan.branches[i - 1][0] == FUSED for i in group[0]):
                        carry.append(loss)
                    grad, grads[c], *rest = self.lane(group, lane_row, weight_grad, *carry)
                    loss = rest[0] if rest else loss

        lanes = {Kind.F: forward_lane, Kind.B: input_grad_lane, Kind.W: weight_grad_lane}
        for kind in plan.order:
            lanes[kind]()
        if self.emulate:  # the messages leave after the tick's end callback
            act, grad = self.emulate.tick_end((act, grad), (res, grads, loss))
        return self.post.end_of_tick(plan, row, msgs, act, grad, late), res, grads, loss

    def tick_loop(
        self,
        params: Buffers,
        x: Any,
        y: Any,
        rows: TickRow,
        pos: jax.Array,
        with_aux: bool = False,
        reduce: Callable[[Buffers], Buffers] | None = None,
        slices: ZeroLayout | None = None,
    ):
        """Run every tick on this device (at pipeline position `pos`); return (the loss
        over the global batch, this device's gradient rows reduced over replicas).
        With `with_aux` the loss is (loss, aux) (see loss.py). `reduce` replaces the
        reduction over replicas (ZeRO's reduce-scatter, zero.py). With `slices`
        (ZeRO's layout) each W's gradient is reduce-scattered into this replica's
        slices as it is made, inside its cond: a fault-free table runs a stage's W
        on every replica in the same tick. No whole accumulator is carried."""
        params = self.chunk_params(params, pos)
        msgs, res, grads = self.empty(self.plan)
        add_grad = None
        if slices is not None:
            grads = [slices.zero_slices() for _ in self.layouts]

            def add_grad(c: int, acc: Buffers, dpar: Any) -> Buffers:
                row = self.layouts[c].leave(dpar, pos, slices.reduce_dtypes)
                return slices.add_scattered(acc, row)

        def tick(carry, row):
            *state, loss = carry
            *state, dloss = self.tick(self.plan, params, x, y, *state, row, add_grad=add_grad)
            return (*state, loss + dloss), None

        (_, _, grads, loss), _ = lax.scan(tick, (msgs, res, grads, self.ops.no_loss()), rows)
        if slices is not None:
            grads = {k: jnp.stack([g[k] for g in grads]) for k in grads[0]}
        else:
            local = self.flat_grads(grads, pos)
            grads = (reduce or self.topo.reduce_over_replicas)(local)
            if self.shared is not None and reduce is None:  # ZeRO's `reduce` sums them first
                grads = self.shared(local, grads)
        total = self.topo.psum(loss, self.topo.axes)
        count = self.sched.replicas * self.sched.microbatches
        factor = self.loss.grad_factor(total, count)
        if factor is not None:  # a weighted loss: divide by the global batch's weight
            grads = {k: g * factor.astype(g.dtype) for k, g in grads.items()}
        value = self.loss.loss(total, count)
        return ((value, self.loss.aux(total)) if with_aux else value), grads
