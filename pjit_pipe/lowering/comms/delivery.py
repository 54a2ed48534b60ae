"""How a tick's messages travel: the ppermutes of the two channels and the writes
into the receiver's message store.

Each channel (activations, made by F; input gradients, made by B, BW or a
fused loss-stage op) has its ppermutes (plan.py, routes.py). A plan whose
ticks use different sets of them gates each tick's set with a switch on the
tick's index, the same on every device. A deferred plan (ir/ticks.py) sends
its late channel at the start of the next tick: the message waits in the
sender's outbox row of its message store, so that its transfer overlaps the
receiver's first lane, which reads only the other channel; the lanes read the
arrivals through (`Arrived.read_through`), and the store is written once, at
the end of the tick.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import late_channel
from pjit_pipe.lowering.comms.messages import MessageSpec
from pjit_pipe.lowering.layout.flat_buffers import Buffers
from pjit_pipe.lowering.tick_plan import TickPlan, TickRow


class Arrived(NamedTuple):
    """Messages that land in one device's message store: the slots (scalar indices)
    and the messages, in the order they are written (a later one wins a slot)."""

    slots: list[jax.Array]
    messages: list[Buffers]

    def write(self, store: Buffers) -> Buffers:
        """`store` with every message written to its slot."""
        for slot, msg in zip(self.slots, self.messages, strict=True):
            store = {k: b.at[slot].set(msg[k]) for k, b in store.items()}
        return store

    def read_through(self, slot: jax.Array, row: Buffers) -> Buffers:
        """What a read of `slot` gives once these messages are written, where `row`
        is what it gave before."""
        for at, msg in zip(self.slots, self.messages, strict=True):
            row = {k: jnp.where(slot == at, msg[k], r) for k, r in row.items()}
        return row


class Post:
    """Sends a device's messages over the mesh axes `axes` and stores what arrives."""

    def __init__(self, spec: MessageSpec, axes: Any):
        self.spec = spec
        self.axes = axes

    def start_of_tick(self, plan: TickPlan, row: TickRow, outbox: Buffers) -> Arrived:
        """A deferred plan's late messages of the tick before sent (`outbox`: this
        device's, read from its outbox row), and what lands here. The tick's lanes
        read through them (`Arrived.read_through`) and `end_of_tick` writes them:
        every write of the tick then follows its one read of the store, so XLA
        updates the store in place."""
        acts_late = late_channel(plan.order) is Kind.F
        none = self.spec.zeros()
        sent = (outbox, none) if acts_late else (none, outbox)
        act, grad = self.arrive(plan, row, sent, (acts_late, not acts_late))
        return act if acts_late else grad

    def end_of_tick(
        self,
        plan: TickPlan,
        row: TickRow,
        msgs: Buffers,
        act: Buffers,
        grad: Buffers,
        late: Arrived | None = None,
    ) -> Buffers:
        """Deliver the tick's activation `act` and input gradient `grad`, and store
        what arrives. In a deferred plan the `late` messages of the tick before are
        written first, and the tick's own late message goes to the outbox."""
        if not plan.deferred:
            arrived = self.arrive(plan, row, (act, grad), (True, True))
            return arrived[1].write(arrived[0].write(msgs))
        acts_late = late_channel(plan.order) is Kind.F
        msgs = late.write(msgs)
        arrived = self.arrive(plan, row, (act, grad), (not acts_late, acts_late))
        msgs = arrived[1 if acts_late else 0].write(msgs)
        sent_late = act if acts_late else grad
        return {k: b.at[plan.outbox].set(sent_late[k]) for k, b in msgs.items()}

    def arrive(
        self,
        plan: TickPlan,
        row: TickRow,
        sent: tuple[Buffers, Buffers],
        channels: tuple[bool, bool],
    ) -> tuple[Arrived | None, Arrived | None]:
        """Run the ppermutes of the (activation, gradient) `channels` that are on,
        sending the (activation, gradient) messages `sent`; per channel that is
        on, what lands in this device's store: its own message in its self slot,
        then what it receives, in the slots `row` names."""

        def send(which):
            on = tuple(idx if c else () for idx, c in zip(which, channels, strict=True))
            return functools.partial(self._send, plan, on)

        if len(plan.sends) == 1:
            received = send(plan.sends[0])(*sent)
        else:  # only the ppermutes some device uses in this tick
            # Collectives in a branch: safe only because every device takes the same
            # one (build_plan gives all devices the tick's index); a ppermute some
            # devices skip deadlocks, or on CPU pairs with another collective and
            # gives wrong numbers (docs/tick_packing.md, "Deferred sends, continued").
            received = lax.switch(row.sends, [send(w) for w in plan.sends], *sent)
        slots = ((row.self_act, row.recv_act), (row.self_grad, row.recv_grad))
        return tuple(
            Arrived([self_slot, *(recv[i] for i in range(len(got)))], [msg, *got]) if on else None
            for on, msg, (self_slot, recv), got in zip(channels, sent, slots, received, strict=True)
        )

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
