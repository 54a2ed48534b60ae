"""The compute a tick can run: one function per (op kind, virtual stage) the plan uses.

Each function takes (chunk params, batch, labels, its lane's `Inbox`, residual
stores (stages.Residuals), its lane's row of the tick, plan.OpRow) and returns
(outgoing message, what it writes, loss share): F and B the residual stores
with their rows written in place, W/BW the parameter gradient. An op never
sees the message store itself: the tick reads each lane's message rows before
any op runs (see tick.py). They are grouped by what they write, because the tick
body (tick.py) runs each group as its own two-way `lax.cond`: all F (they
write the residual stores), all B (they write their cotangents to the W-pool), and the
W/BW of each chunk (they add into that chunk's gradient accumulator), with the loss
stage's fused F and backward (plan.FUSED), which adds its loss share too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.comms.messages import MessageSpec
from pjit_pipe.lowering.compute.loss import LossLayout
from pjit_pipe.lowering.compute.rng import microbatch_rngs
from pjit_pipe.lowering.compute.stages import Residuals, StageVjp
from pjit_pipe.lowering.layout.flat_buffers import Buffers
from pjit_pipe.lowering.layout.param_layout import ChunkLayout
from pjit_pipe.lowering.tick_plan import FUSED, BranchKind

OpGroup = tuple[list[int], list[Callable]]  # (branch ids, their op functions)


class Inbox(NamedTuple):
    """The received messages one lane's op reads, as rows taken from the message
    store (one (message size,) array per dtype); a row the op does not read is
    the scratch slot's or zeros."""

    act: Buffers  # its input activation (slot `in_slot`): F, and B/W/BW under remat
    grad: Buffers  # the gradient of its output (slot `g_slot`): B, W, BW


def store_row(bufs: Buffers, i: Any) -> Buffers:
    """Slot i of a (slots, ...) store, one array per dtype."""
    return {k: lax.dynamic_index_in_dim(b, i, keepdims=False) for k, b in bufs.items()}


class StageOps:
    """The op functions of one program, grouped for the tick body.

    layouts[c]: how the loop holds chunk c's parameters and gradient (an op
    unpacks its stage's tree from them and packs its gradient into them; see
    param_layout.py). `loss_mult` scales the last stage's loss vector (see loss.py).
    `stub(kind, stage, op)`, when given, replaces each op function (an emulated
    run's, emulated_ticks.py).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: StageVjp,
        branches: tuple[tuple[BranchKind, int], ...],
        msg_spec: MessageSpec,
        layouts: list[ChunkLayout],
        remat: bool,
        loss: LossLayout,
        rng_impls: dict[str, Any] | None,
        stub: Callable[[BranchKind, int, Callable], Callable] | None = None,
    ):
        self.sched, self.st, self.branches = schedule, stages, branches
        self.msg_spec, self.layouts = msg_spec, layouts
        self.remat, self.loss, self.rng_impls = remat, loss, rng_impls
        self.stub = stub  # an emulated run's: (kind, stage, op) -> the op's stand-in
        self.scale = 1.0 / (schedule.replicas * schedule.microbatches)
        self.loss_mult = loss.accumulate_scale(self.scale)
        self.forwards = self.group((Kind.F,))
        self.input_grads = self.group((Kind.B,))
        # One W/BW group per chunk: the chunk's gradient is a static operand. A fused
        # loss-stage F and backward (plan.FUSED) runs in it too.
        self.weight_grads = [
            self.group((Kind.W, Kind.BW, FUSED), chunk=c) for c in range(schedule.chunks)
        ]
        # A tick's second W (ir.ticks.W_PER_TICK): W's alone, per chunk.
        self.second_weight_grads = [self.group((Kind.W,), chunk=c) for c in range(schedule.chunks)]

    def group(self, kinds: tuple[BranchKind, ...], chunk: int | None = None) -> OpGroup:
        """(branch ids, op functions) of the branches of these kinds (and of
        virtual stages in this chunk, if given)."""
        ids = [
            1 + i
            for i, (k, s) in enumerate(self.branches)
            if k in kinds and chunk in (None, self.sched.chunk_of(s))
        ]
        return ids, [self.op(*self.branches[i - 1]) for i in ids]

    def no_loss(self) -> jax.Array:
        """The loss-vector share of an op that computes no loss (see loss.py)."""
        return jnp.zeros((self.loss.size,), jnp.float32)

    def op(self, kind: BranchKind, s: int) -> Callable:
        """One (kind, virtual stage): (msg, residual row or parameter gradient, loss share)."""
        S, c, st = self.st.S, self.sched.chunk_of(s), self.st

        def stage_input(x, inbox, row):
            if s == 0:
                return jax.tree.map(lambda a: a[row.mb], x)
            return self.msg_spec.unpack_act(s - 1, inbox.act)

        def run(params, x, y, inbox: Inbox, res, row):
            msg = self.msg_spec.zeros()
            p = self.layouts[c].unpack(s, params[c])
            y_mb = jax.tree.map(lambda a: a[row.mb], y) if s == S - 1 else None
            if kind == FUSED:  # the loss stage's value_and_grad: nothing stored
                out, dparams, dinput = st.value_and_grad(
                    s, p, stage_input(x, inbox, row), y_mb, self.loss.seed(self.scale)
                )
                if s > 0:
                    msg = self.msg_spec.pack_grad(s - 1, dinput)
                return msg, self.layouts[c].pack(s, dparams), out * self.loss_mult
            if kind is Kind.F:
                a = stage_input(x, inbox, row)
                if self.remat:
                    out = st.remat_forward(s, p, a, y_mb)
                else:
                    out, res = st.forward_into(s, p, a, y_mb, res, row.bres_w, row.res_w)
                if s == S - 1:
                    return msg, res, out * self.loss_mult
                return self.msg_spec.pack_act(s, out), res, self.no_loss()
            if s == S - 1:
                g = self.loss.seed(self.scale)
            else:
                g = self.msg_spec.unpack_grad(s, inbox.grad)
            r = Residuals(store_row(res.b, row.bres_r), store_row(res.w, row.res_r))
            if s in st.split:  # see split_backward.py
                if kind is Kind.B:  # its cotangents go into the W-pool row W reads
                    dinput, w_store = st.input_grad(s, p, r, g, res.w, row.res_r)
                    res = res._replace(w=w_store)
                elif kind is Kind.W:
                    dparams, dinput = st.weight_grad(s, p, r), None
                else:
                    dparams, dinput = st.fused_grad(s, p, r, g)
            else:
                if self.remat:
                    grads = st.recompute_backward(s, p, stage_input(x, inbox, row), y_mb, g)
                else:
                    grads = st.backward(s, p, r, g)
                dparams, dinput = grads if s > 0 else (grads[0], None)
            if kind in (Kind.B, Kind.BW) and s > 0:
                msg = self.msg_spec.pack_grad(s - 1, dinput)
            if kind is Kind.B:
                return msg, res, self.no_loss()
            return msg, self.layouts[c].pack(s, dparams), self.no_loss()

        run = run if self.rng_impls is None else self._with_rngs(run)
        run = _named(f"{kind} stage {s}", run)
        return run if self.stub is None else self.stub(kind, s, run)

    def _with_rngs(self, op: Callable) -> Callable:
        """op with its microbatch's keys in scope (see rng.py); the device batch is
        (x, per-microbatch key data), split like x."""

        def run(params, batch, y, inbox, res, row):
            x, keys = batch
            mine = {k: d[row.mb, 0] for k, d in keys.items()}
            with microbatch_rngs(mine, self.rng_impls):
                return op(params, x, y, inbox, res, row)

        return run


def _named(name: str, op: Callable) -> Callable:
    """`op` under the name scope `name`: its HLO ops' metadata names the op kind and
    stage (op_name), so compiled kernels can be traced back to the op that made
    them (benchmarks/bench_kernels.py). Metadata only: the program is the same."""

    def run(*args: Any) -> Any:
        with jax.named_scope(name):
            return op(*args)

    return run
