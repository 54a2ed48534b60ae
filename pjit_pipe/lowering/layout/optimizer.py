"""Each held stage's optax step, after the tick loop or inside it.

An unstaggered single-iteration step runs every stage's update after the loop
(`optimizer_step`). Staggered or multi-iteration training steps each stage's
optimizer inside the loop, right after the tick of its last W/BW of the
iteration (`stepping_loop`), so later ticks read the new parameters. An
asynchronous schedule steps each stage after every microbatch's W/BW, and its
weight policy (async_weights.py) picks the weights each tick's ops read.

Optimizer state lives in the device layout, (v, L) rows per dtype on each
device like the parameters (see device_state.py); an update unpacks one
stage's rows, runs optax on its tree and packs the result back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from pjit_pipe.lowering.comms.topology import over_devices
from pjit_pipe.lowering.compute.tick import TickProgram
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec
from pjit_pipe.lowering.layout.global_norm import SUM, StageNorms, count_norm_calls, stage_norms
from pjit_pipe.lowering.layout.row_optimizer import RowOptimizer
from pjit_pipe.lowering.tick_plan import TickPlan, TickRow


def stage0_avals(prog: TickProgram, optimizer: optax.GradientTransformation) -> tuple[Any, Any]:
    """(parameter avals, optax state avals) of virtual stage 0: what norm counting traces."""
    p = prog.st.param_avals[0]
    return p, jax.eval_shape(optimizer.init, p)


class StageOptimizer:
    """The optimizer steps of one TickProgram (see the module docstring)."""

    def __init__(
        self,
        prog: TickProgram,
        optimizer: optax.GradientTransformation,
        rows: RowOptimizer | None = None,
    ):
        self.prog = prog
        self.optimizer = optimizer
        self.rows = rows  # the step on whole rows, when the update is leafwise

    def stepping_loop(
        self,
        opt_spec: FlatSpec,
        params: Buffers,
        opt: Buffers,
        x: Any,
        y: Any,
        rows: TickRow,
        updates: jax.Array,
        pos: jax.Array,
        plan: TickPlan | None = None,
        in_flight: tuple[Buffers, Buffers, Buffers, jax.Array] | None = None,
    ):
        """Several iterations with each stage's optimizer step inside the tick loop.

        After a tick flagged in `updates` (the same flag on every device, so the
        reduction's collectives run everywhere or nowhere), the chunks whose
        `update` bit is set reduce their gradients over their live replicas, take
        the optax step and restart accumulating; later ticks read the new
        parameters. Returns (params, opt state, loss of each iteration).

        A weighted loss divides a chunk's gradients by its iteration's total
        weight at its step: every last-stage F of an iteration precedes every
        W of it, so the psum of the loss vectors then holds the whole weight.

        `plan` (default: the program's) and `in_flight` run a steady-state window
        of an asynchronous program (async_carry.py): the loop starts from the
        given (message store, residual store, weight-policy buffers, per-iteration
        loss vectors) and returns (params, opt state, those four at its end).
        """
        prog = self.prog
        plan = prog.step_plan if plan is None else plan
        v, iterations = prog.sched.chunks, prog.iterations
        count = prog.sched.replicas * prog.sched.microbatches
        msgs, res, grads = prog.empty(plan)
        weights = prog.weights
        # An asynchronous schedule's weight-policy buffers (async_weights.py): predict: the
        # last update, (v, L) rows per dtype; stash: (R + 1, v, L) versions; latest: none.
        wcarry = weights.init(params, plan.res_slots) if weights else {}
        # Per iteration, this device's summed loss vectors (see loss.py): (iterations, size).
        losses = jnp.zeros((iterations, prog.loss.size), jnp.float32)
        if in_flight is not None:
            msgs, res, wcarry, losses = in_flight
        # Per chunk, the optimizer steps taken so far: the iteration of its next step. (v,)
        done = jnp.zeros((v,), jnp.int32)
        # Per chunk, the parameters as the ticks read them (param_layout.py: one 1-D
        # buffer per size-class slot, or the chunk's (L,) row per dtype), made anew
        # only by an optimizer step; a weight policy makes them every tick instead.
        chunks = prog.chunk_params(params, pos) if weights is None else []

        def chain(stepper: frozenset[tuple[int, int]], c: int) -> Callable:
            """Chunk c's reduction over the live holders of the positions that step it
            in a tick of `stepper` (a plan.TickPlan.steppers entry)."""
            positions = [p for p, chunk in stepper if chunk == c]
            return functools.partial(prog.topo.reduce_over_replicas, positions=positions)

        def step(row, losses, stepper, grads, state):
            params, chunks, opt, done, wcarry = state
            mine = ((row.update >> jnp.arange(v)) & 1).astype(bool)[:, None]
            g = {
                k: jnp.where(_per_chunk(mine, b), b, 0)
                for k, b in prog.flat_grads(grads, pos).items()
            }
            rows = [{k: b[c] for k, b in g.items()} for c in range(v)]
            if prog.topo.complete:
                # Every holder of a stage steps it in the same tick, so the devices of
                # each 'data' group (one psum) agree on these predicates: a device
                # reduces a chunk's gradient row only at that chunk's step.
                reduce = prog.topo.reduce_over_replicas
                rows = [lax.cond(mine[c, 0], reduce, lambda t: t, r) for c, r in enumerate(rows)]
            else:
                # One ppermute chain serves every stepping position, so each device
                # must run it, stepping or not: a switch on the tick's `stepper`, the
                # same everywhere (a chain some devices skip pairs other collectives).
                rows = [
                    lax.switch(stepper - 1, [chain(st, c) for st in plan.steppers[1:]], r)
                    for c, r in enumerate(rows)
                ]
            g = {k: jnp.stack([r[k] for r in rows]) for k in g}
            if weights is not None:  # one microbatch's gradient per step
                g = weights.step_gradients(g)
            elif prog.loss.weighted:  # per chunk, its iteration's count / total weight
                factor = prog.loss.grad_factor(prog.topo.psum(losses, prog.topo.axes), count)
                f = factor[jnp.minimum(done, iterations - 1)][:, None]
                g = {k: b * f.astype(b.dtype) for k, b in g.items()}
            params, opt = self.optimizer_step(opt_spec, params, g, opt, pos, mine[:, 0])
            if weights is not None:
                wcarry = weights.after_step(wcarry, state[0], params, mine)
            else:
                chunks = prog.chunk_params(params, pos)
            return params, chunks, opt, done + mine[:, 0], wcarry

        def tick(carry, inputs):
            row, stepper = inputs
            msgs, res, grads, losses, params, chunks, opt, done, wcarry = carry
            if weights is None:
                now, back = chunks, None
            else:  # the forward and the backward may read other weights
                ahead, behind, wcarry = weights.views(params, wcarry, row, pos)
                now, back = prog.chunk_params(ahead, pos), prog.chunk_params(behind, pos)
            msgs, res, grads, dloss = prog.tick(plan, now, x, y, msgs, res, grads, row, back)
            # Only a loss-stage F makes a loss, or a fused group (plan.FUSED) in the W
            # lane, whose tick's F lane then idles.
            it = jnp.where(row.f.branch > 0, row.f.iteration, row.w.iteration)
            losses = losses.at[it].add(dloss)
            before = done
            params, chunks, opt, done, wcarry = lax.cond(
                stepper > 0,
                functools.partial(step, row, losses, stepper, grads),
                lambda s: s,
                (params, chunks, opt, before, wcarry),
            )
            # A stepped chunk's gradient starts again from zero; outside the cond, which
            # would copy the accumulator twice a tick (into its output and back). The
            # flag is read off the cond's output, so the cond's reads come first.
            stepped = done > before
            grads = [
                jax.tree.map(lambda a, m=stepped[c]: jnp.where(m, 0, a), g)
                for c, g in enumerate(grads)
            ]
            return (msgs, res, grads, losses, params, chunks, opt, done, wcarry), None

        carry = (msgs, res, grads, losses, params, chunks, opt, done, wcarry)
        (msgs, res, _, losses, params, _, opt, _, wcarry), _ = lax.scan(
            tick, carry, (rows, updates)
        )
        if in_flight is not None:
            return params, opt, (msgs, res, wcarry, losses)
        return params, opt, prog.loss.loss(prog.topo.psum(losses, prog.topo.axes), count)

    def optimizer_step(
        self, opt_spec: FlatSpec, params, grads, opt, pos: jax.Array, keep: jax.Array | None = None
    ):
        """Each held stage's OPT: the optax update of its own parameter pytree.

        `pos` is this device's pipeline position (it picks the stages to update).
        With `keep` (a bool for every chunk, `finite`'s verdict, or one per chunk,
        those that step) a chunk's new values are taken only where it is true,
        else the old ones.
        An optimizer that takes tree norms (clip_by_global_norm) first runs one
        pass per norm call that only finds its whole-model value (see global_norm.py).
        A leafwise one runs on the whole rows instead (row_optimizer.py).
        """
        if self.rows is not None:  # one elementwise rule: whole rows, no switch
            return self.rows.step(params, grads, opt, keep)
        prog, optimizer = self.prog, self.optimizer

        def stage_args(s, c):
            p = prog.param_spec.unpack(s, {k: b[c] for k, b in params.items()})
            g = prog.param_spec.unpack(s, {k: b[c] for k, b in grads.items()})
            return p, g, opt_spec.unpack(s, {k: b[c] for k, b in opt.items()})

        known: list[jax.Array] = []
        for k in range(count_norm_calls(optimizer, *stage0_avals(prog, optimizer))):
            combine: list[str] = []

            def local_norm(s, c, k=k, combine=combine):
                p, g, o = stage_args(s, c)
                with stage_norms(StageNorms(known, k, self._uncounted(s))) as norms:
                    optimizer.update(g, o, p)
                combine.append(norms.combine)
                return norms.recorded

            known.append(self._across_stages(self._each_chunk(local_norm, pos), combine[0]))

        def update(s, c):
            with jax.named_scope(f"OPT stage {s}"):  # metadata only: see tick_ops._named
                p, g, o = stage_args(s, c)
                with stage_norms(StageNorms(known, None)) if known else contextlib.nullcontext():
                    upd, o = optimizer.update(g, o, p)
                return prog.param_spec.pack(s, optax.apply_updates(p, upd)), opt_spec.pack(s, o)

        out = self._each_chunk(update, pos)
        new = (
            {k: jnp.stack([p_c[k] for p_c, _ in out]) for k in params},
            {k: jnp.stack([o_c[k] for _, o_c in out]) for k in opt},
        )
        if keep is None:
            return new
        return jax.tree.map(
            lambda n, o: jnp.where(_per_chunk(jnp.broadcast_to(keep, o.shape[:1]), o), n, o),
            new,
            (params, opt),
        )

    def finite(self, loss: jax.Array, grads: Buffers) -> jax.Array:
        """Whether the loss and the whole model's gradient norm are finite (the
        non-finite check's verdict, a scalar bool). The norm counts each stage
        once (its first live holder), and every device takes the same choice."""
        # A dot product: the XLA:CPU of jax 0.10-0.11 materializes the squares of a sum
        # of squares first (that of 0.12 materializes both inside the step's program).
        local = sum(_dot_self(g) for g in grads.values())
        squared_norm = self._across_stages([local], SUM)
        return jnp.all(jnp.isfinite(loss)) & jnp.isfinite(squared_norm)

    def _uncounted(self, s: int) -> frozenset[str]:
        """Tied units stage s holds whose norm its first holder counts instead."""
        shared = self.prog.shared
        units = shared.holders.items() if shared is not None else ()
        return frozenset(u for u, holders in units if s in holders and s != min(holders))

    def _each_chunk(self, fn: Callable[[int, int], Any], pos: jax.Array) -> list[Any]:
        """Per chunk c, fn(s, c) for the stage s this device holds there (a switch
        on the pipeline position: no collective may run inside fn)."""
        sched, held = self.prog.sched, self.prog.held
        out = []
        for c in range(sched.chunks):
            stages_c = [held[p][c] for p in range(sched.stages)]
            which = jnp.asarray(np.argsort(np.argsort(stages_c)), jnp.int32)[pos]
            out.append(lax.switch(which, [functools.partial(fn, s, c) for s in sorted(stages_c)]))
        return out

    def _across_stages(self, per_chunk: list[jax.Array], combine: str) -> jax.Array:
        """Combine one value per stage over the whole model, each stage counted once:
        only the first live holder of each position contributes (replicas hold
        the same stages)."""
        topo, P = self.prog.topo, self.prog.sched.stages
        local = functools.reduce(jnp.add if combine == SUM else jnp.maximum, per_chunk)
        first = np.zeros(len(topo.workers), bool)
        first[[topo.holders(p)[0] for p in range(P)]] = True
        if topo.complete:
            me = lax.axis_index("data") * P + lax.axis_index("stage")
        else:
            me = lax.axis_index(topo.axes[0])
        local = jnp.where(jnp.asarray(first)[me], local, 0.0)
        return over_devices(lax.psum if combine == SUM else lax.pmax, local, topo.axes)


def _per_chunk(mine: jax.Array, buf: jax.Array) -> jax.Array:
    """A (v,) or (v, 1) per-chunk flag shaped to broadcast over a (v, ...) buffer (a
    flat row, or a shaped buffer of a leaf split over 'tensor')."""
    return mine.reshape(mine.shape[0], *([1] * (buf.ndim - 1)))


def _dot_self(g: jax.Array) -> jax.Array:
    """sum(g * g) in float32, as one dot product (finite's comment)."""
    flat = jnp.ravel(g).astype(jnp.float32)
    return jnp.dot(flat, flat, precision=lax.Precision.HIGHEST)
