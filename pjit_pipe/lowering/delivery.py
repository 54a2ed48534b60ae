"""How a tick's messages travel: the ppermutes of the two channels and the writes
into the receiver's message store.

Each channel (activations, made by F; input gradients, made by B, BW or a
fused loss-stage op) has its ppermutes (plan.py, routes.py). A plan whose
ticks use different sets of them gates each tick's set with a switch on the
tick's index, the same on every device. A deferred plan (ir/ticks.py) sends
its late channel at the start of the next tick: the message waits in the
sender's outbox row of its message store, so that its transfer overlaps the
receiver's first lane, which reads only the other channel.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import late_channel
from pjit_pipe.lowering.messages import MessageSpec
from pjit_pipe.lowering.packing import Buffers
from pjit_pipe.lowering.plan import TickPlan, TickRow


class Post:
    """Sends a device's messages over the mesh axes `axes` and stores what arrives."""

    def __init__(self, spec: MessageSpec, axes: Any):
        self.spec = spec
        self.axes = axes

    def start_of_tick(self, plan: TickPlan, row: TickRow, msgs: Buffers, token: Any) -> Buffers:
        """A deferred plan's late messages of the tick before, delivered; the writes
        come after whatever made `token` (a read of the store: see `after`)."""
        late = {k: b[plan.outbox] for k, b in msgs.items()}
        none = self.spec.zeros()
        acts_late = late_channel(plan.order) is Kind.F
        sent = (late, none) if acts_late else (none, late)
        return self.deliver(plan, row, msgs, sent, (acts_late, not acts_late), token)

    def end_of_tick(
        self, plan: TickPlan, row: TickRow, msgs: Buffers, act: Buffers, grad: Buffers
    ) -> Buffers:
        """Deliver the tick's activation `act` and input gradient `grad`; in a
        deferred plan, the late one goes to the outbox instead."""
        if not plan.deferred:
            return self.deliver(plan, row, msgs, (act, grad), (True, True))
        acts_late = late_channel(plan.order) is Kind.F
        msgs = self.deliver(plan, row, msgs, (act, grad), (not acts_late, acts_late))
        late = act if acts_late else grad
        return {k: b.at[plan.outbox].set(late[k]) for k, b in msgs.items()}

    def deliver(
        self,
        plan: TickPlan,
        row: TickRow,
        msgs: Buffers,
        sent: tuple[Buffers, Buffers],
        channels: tuple[bool, bool],
        token: Any = None,
    ) -> Buffers:
        """Run the ppermutes of the (activation, gradient) `channels` that are on,
        sending the (activation, gradient) messages `sent`, and store what this
        device receives, and what it sends itself, in the slots `row` names (after
        whatever made `token`, when given)."""

        def send(which):
            on = tuple(idx if c else () for idx, c in zip(which, channels, strict=True))
            return functools.partial(self._send, plan, on)

        if len(plan.sends) == 1:
            received = send(plan.sends[0])(*sent)
        else:  # only the ppermutes some device uses in this tick
            # Collectives in a branch: safe only because every device takes the same
            # one (build_plan gives all devices the tick's index); a branch some
            # devices skip would deadlock (DESIGN.md, JAX facts).
            received = lax.switch(row.sends, [send(w) for w in plan.sends], *sent)
        slots = ((row.self_act, row.recv_act), (row.self_grad, row.recv_grad))
        if token is not None:
            slots = tuple((after(token, s), after(token, r)) for s, r in slots)
        for on, msg, (self_slot, recv), got in zip(channels, sent, slots, received, strict=True):
            if on:
                msgs = {k: b.at[self_slot].set(msg[k]) for k, b in msgs.items()}
                for i, m in enumerate(got):
                    msgs = {k: b.at[recv[i]].set(m[k]) for k, b in msgs.items()}
        return msgs

    def _send(self, plan: TickPlan, which: tuple[tuple[int, ...], tuple[int, ...]], act, grad):
        """Per channel, what each of its ppermutes delivers to this device: the
        ppermutes in `which` (activation, gradient indices) run, the others give
        zeros (their receive slots are then the scratch slot)."""
        out = []
        for msg, shifts, run in (
            (act, plan.act_shifts, which[0]),
            (grad, plan.grad_shifts, which[1]),
        ):
            out.append(
                [
                    lax.ppermute(msg, self.axes, perm=pairs) if i in run else self.spec.zeros()
                    for i, (_, pairs) in enumerate(shifts)
                ]
            )
        return tuple(out)


def after(token: Buffers, index: jax.Array) -> jax.Array:
    """`index`, computed from `token` as well, so that XLA runs what uses it after
    whatever made `token` (it orders ops by data dependence only).

    Under the lane order B, W, F the tick's F writes residual slots that its B, W
    and BW have just read (their conds take the stores as read-only operands).
    Unless F's in-place writes depend on those conds, XLA cannot tell that the
    reads come first and copies the whole residual store on every tick. F's slot
    indices are therefore made to depend on the gradient message, the output of
    the B and W lanes: max(index, -|bits of one element|) is `index` exactly
    (an index is >= 0, the other side <= 0), whatever the element holds, NaN
    included, and XLA does not fold it away (an optimization_barrier or a
    pass-through output does not survive to its copy insertion)."""
    leaf = jnp.ravel(jax.tree.leaves(token)[0])[0]
    if jnp.iscomplexobj(leaf):
        leaf = leaf.real
    if jnp.issubdtype(leaf.dtype, jnp.floating):  # its bits: no NaN to convert
        leaf = lax.bitcast_convert_type(leaf, jnp.dtype(f"int{leaf.dtype.itemsize * 8}"))
    return lax.max(index, -lax.abs(leaf.astype(jnp.int32)))
