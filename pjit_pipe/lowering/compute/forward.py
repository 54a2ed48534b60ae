"""The pipelined forward pass: the schedule's F ops only, returning the model outputs.

For evaluation and generation the same stages run on the same mesh, but only
their forwards: the schedule with every B, W, BW and OPT removed (for 1F1B
that is GPipe's forward half, m + P - 1 ticks). The program is the training
program's own tick loop (same messages, same placement and re-routing after
failures), compiled with recomputation so that F stores no residuals. The last
stage's "loss" is its output, flattened to a float32 vector, and each one is
kept in the row of its microbatch instead of being summed; the host gathers
the rows back into global batch order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.lowering.comms.topology import Topology
from pjit_pipe.lowering.compute.rng import check_rngs, impls_of, microbatch_rngs
from pjit_pipe.lowering.compute.stages import StageVjp
from pjit_pipe.lowering.compute.tick import TickProgram
from pjit_pipe.lowering.layout.tensor_layout import LeafSplits, any_split
from pjit_pipe.lowering.program import _abstract, _check
from pjit_pipe.lowering.step import PipelineStep


class OutputLayout:
    """The last stage's output as the vector the tick loop carries (in place of a
    loss.LossLayout): every leaf flattened to float32, nothing differentiated."""

    def __init__(self, out_aval: Any):
        leaves, self.treedef = jax.tree.flatten(out_aval)
        self.avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]
        self.sizes = [int(np.prod(a.shape, dtype=np.int64)) for a in self.avals]
        self.size = max(1, sum(self.sizes))
        self.has_aux = False

    def vector(self, out: Any, y: Any) -> jax.Array:
        del y
        parts = [jnp.ravel(a).astype(jnp.float32) for a in jax.tree.leaves(out)]
        return jnp.concatenate(parts) if parts else jnp.zeros((1,), jnp.float32)

    def accumulate_scale(self, scale: float) -> np.ndarray:
        del scale
        return np.ones((self.size,), np.float32)

    def unflatten(self, rows: jax.Array) -> Any:
        """(microbatches, size) rows -> the outputs over the global batch."""
        out, start = [], 0
        for aval, n in zip(self.avals, self.sizes, strict=True):
            part = rows[:, start : start + n].reshape(-1, *aval.shape[1:])
            out.append(part.astype(aval.dtype))
            start += n
        return jax.tree.unflatten(self.treedef, out)


def forward_schedule(schedule: Schedule) -> Schedule:
    """The schedule with only its forwards (the order of each worker's F ops kept)."""
    programs = {
        w: tuple(op for op in ops if op.kind is Kind.F) for w, ops in schedule.programs.items()
    }
    return schedule.replace(programs=programs)


class ForwardStep(PipelineStep):
    """A compiled pipelined forward for one schedule and one input shape."""

    def __init__(self, schedule: Schedule, lowered: TickProgram, outputs: OutputLayout, examples):
        super().__init__(schedule, lowered, None, examples)
        self.outputs = outputs
        plan, S = lowered.plan, lowered.st.S
        last = [i + 1 for i, (k, s) in enumerate(plan.branches) if (k, s) == (Kind.F, S - 1)]
        self._last_ids = np.asarray(last, np.int32)
        # Global microbatch g = r*m + j -> (device, local row) of its last-stage F.
        m = schedule.microbatches
        where = {}
        for d, t in zip(*np.nonzero(np.isin(plan.rows.f.branch, last)), strict=True):
            row = int(plan.rows.f.mb[d, t])
            _, r, j = plan.inputs[d, row]
            where[int(r) * m + int(j)] = (int(d), row)
        order = [where[g] for g in range(schedule.replicas * m)]
        self._gather = tuple(np.asarray(a, np.int32) for a in zip(*order, strict=True))
        self._fwd = jax.jit(self._forward)

    def _loop(self, params, x, y, rows, pos):
        """Every tick on this device; returns its last-stage outputs by local row."""
        low = self._low
        chunks = low.chunk_params(params, pos)
        msgs, res, _ = low.empty(low.plan)
        outs = jnp.zeros((low.plan.inputs.shape[1], self.outputs.size), jnp.float32)

        def tick(carry, row):
            msgs, outs = carry
            msgs, _, _, vec = low.tick(low.plan, chunks, x, y, msgs, res, [], row)
            mine = jnp.isin(row.f.branch, jnp.asarray(self._last_ids))
            outs = outs.at[row.f.mb].set(jnp.where(mine, vec, outs[row.f.mb]))
            return (msgs, outs), None

        (_, outs), _ = lax.scan(tick, (msgs, outs), rows)
        return outs

    def _forward(self, stage_params, x, y):
        def body(params, x, y, rows, pos):
            params, x, y, rows, pos = self._local(params, x, y, rows, pos)
            return self._loop(params, x, y, rows, pos)[None]

        f = self._shard_map(body, 1, self.topology.spec)
        spec = self._low.param_spec
        outs = f(
            self._placed(spec, self._pack(spec, stage_params)),
            *self._device_args(x, y, self._low.plan),
        )
        return self.outputs.unflatten(outs[self._gather])

    def forward(self, stage_params: Sequence[Any], x: Any, rngs: Any = None) -> Any:
        """The model's outputs for the global batch x (float leaves, in x's order)."""
        batch = jax.tree.leaves(x)[0].shape[0]
        y = jnp.zeros((batch,), jnp.float32)  # the last stage reads no labels
        return self._fwd(list(stage_params), self._with_keys(x, rngs), y)


def lower_forward(
    schedule: Schedule,
    stage_fns: Sequence[Callable],
    mesh: Mesh,
    stage_params: Sequence[Any],
    x: Any,
    rngs: Any = None,
    splits: Sequence[LeafSplits] | None = None,
) -> ForwardStep:
    """Compile the forward-only pipeline of `schedule` (see the module docstring);
    the arguments are those of `lower` (x an example; no labels, loss or optimizer)."""
    splits = splits if any_split(splits) else None
    y = jnp.zeros((jax.tree.leaves(x)[0].shape[0],), jnp.float32)  # no labels: a stand-in
    _check(schedule, stage_fns, mesh, stage_params, x, y)
    n = schedule.replicas * schedule.microbatches
    mb = lambda a: jax.ShapeDtypeStruct((np.shape(a)[0] // n, *np.shape(a)[1:]), jnp.result_type(a))  # noqa: E731
    impls, example_keys = None, {}
    if rngs is not None:
        typed = check_rngs(rngs)
        impls, example_keys = impls_of(typed), {k: jax.random.key_data(v) for k, v in typed.items()}
    params, x_mb = _abstract(list(stage_params)), jax.tree.map(mb, x)
    with microbatch_rngs(example_keys, impls) if impls else contextlib.nullcontext():
        act = x_mb
        for f, p in zip(stage_fns[:-1], params[:-1], strict=True):
            act = jax.eval_shape(f, p, act)
        outputs = OutputLayout(jax.eval_shape(stage_fns[-1], params[-1], act))
        stages = StageVjp(stage_fns, outputs.vector, params, x_mb, jax.tree.map(mb, y))
    fwd = forward_schedule(schedule)
    topology = Topology.of(mesh, schedule.failed)
    program = TickProgram(fwd, stages, topology, True, loss=outputs, rng_impls=impls, splits=splits)
    return ForwardStep(fwd, program, outputs, (params, _abstract(x), _abstract(y)))
