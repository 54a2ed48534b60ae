"""Failure variants and staggered optimizer steps in the compiled program.

Every single-failure pattern of a 2x4 and a 4x2 mesh (and two multi-failure
patterns) must give the loss and gradients of the fault-free step on the same
global batch, and both must equal jax.value_and_grad of the unpipelined model.
Five staggered steps compiled into one call must equal five steps of
unpipelined adam.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_lowering import (
    MB,
    assert_trees_close,
    batch,
    mesh_of,
    reference_value_and_grad,
    tiny_model,
    unpipelined_training,
    xent,
)

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.simulator.simulate import packed_time
from pjit_pipe.tick_packing.packer import pack_ticks
from tests.tiers import EXHAUSTIVE

M = 4
PATTERNS = [(D, P, ((r, s),)) for D, P in ((2, 4), (4, 2)) for r in range(D) for s in range(P)] + [
    (4, 2, ((0, 0), (2, 1))),
    (4, 2, ((1, 0), (3, 0))),
]


@pytest.fixture(scope="module")
def fault_free():
    """(loss, grads) of the fault-free zb-h1 step per mesh shape, and the reference."""
    out = {}
    for D, P in ((2, 4), (4, 2)):
        fns, params = tiny_model(P)
        x, y = batch(D * M * MB, seed=3)
        step = lower(
            make_schedule("zb-h1", P, M, replicas=D), fns, xent, mesh_of(D, P), params, x, y
        )
        ref = reference_value_and_grad(fns, params, x, y)
        out[(D, P)] = (fns, params, x, y, step.value_and_grad(params, x, y), ref)
    return out


# A single failure in replica r > 0 is one in replica 0 up to a permutation of the
# replicas (the variants fold them into one program): those run only when asked.
@pytest.mark.parametrize(
    "D,P,failed",
    [
        pytest.param(
            D,
            P,
            f,
            marks=EXHAUSTIVE if len(f) == 1 and f[0][0] > 0 else (),
            id=f"{D}x{P}-" + "+".join(f"{r}:{s}" for r, s in f),
        )
        for D, P, f in PATTERNS
    ],
)
def test_variant_equals_fault_free_step(fault_free, D, P, failed):
    fns, params, x, y, (loss0, grads0), (ref_loss, ref_grads) = fault_free[(D, P)]
    sched = schedule_with_failures("zb-h1", P, M, D, failed, time_limit=2.0)
    step = lower(sched, fns, xent, mesh_of(D, P), params, x, y)
    dead = {mesh_of(D, P).devices[r, s] for r, s in failed}
    assert not dead & set(step.mesh.devices.flat), "a failed device is in the variant's mesh"
    assert step.mesh.devices.size == D * P - len(failed)
    loss, grads = step.value_and_grad(params, x, y)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    assert_trees_close(grads, grads0)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)


def test_polished_rerouted_table_equals_fault_free_step(fault_free):
    """A re-routed variant's tick table polished by exact windows (tick_packing/tick_milp.py)
    runs its ops in other ticks than the greedy's, with the same numbers."""
    fns, params, x, y, (loss0, grads0), _ = fault_free[(2, 4)]
    sched = schedule_with_failures("zb-h1", 4, M, 2, [(0, 1)], time_limit=2.0)
    costs = Costs(1, 2, 1)
    table = pack_ticks(sched, costs, polish=1.0)
    assert packed_time(table, costs) < packed_time(pack_ticks(sched, costs), costs)
    step = lower(table, fns, xent, mesh_of(2, 4), params, x, y)
    loss, grads = step.value_and_grad(params, x, y)
    assert abs(float(loss) - float(loss0)) <= 1e-5 * abs(float(loss0))
    assert_trees_close(grads, grads0)


def test_rerouted_work_crosses_replicas():
    """The variant really runs a failed worker's microbatches on its peers."""
    sched = schedule_with_failures("1f1b", 4, M, 2, [(0, 1)], time_limit=2.0)
    moved = [op for op in sched.program(Worker(1, 1)) if op.replica == 0]
    assert len(moved) >= M  # every microbatch of (0, 1) runs on (1, 1)
    assert FailurePattern.of(2, 4, [(0, 1)]).survivors(1) == [1]
    np.testing.assert_array_equal(sorted({op.mb for op in moved}), range(M))


@pytest.mark.parametrize(
    "kind,D,P,failed",
    [("zb-h2", 2, 4, ()), ("1f1b", 4, 2, ((2, 1),))],
    ids=["zb-h2-2x4", "1f1b-4x2-rerouted"],
)
def test_five_staggered_steps_equal_five_synchronous_ones(kind, D, P, failed):
    """One call runs five iterations, each stage stepping its optimizer as soon as
    its gradients are complete; the result is unpipelined adam's, step by step."""
    if failed:
        sched = schedule_with_failures(kind, P, M, D, failed, time_limit=1.0)
    else:
        sched = stagger(make_schedule(kind, P, M, replicas=D))
    assert sched.staggered
    fns, params = tiny_model(P)
    opt = optax.adam(1e-2)
    batches = [batch(D * M * MB, seed=20 + i) for i in range(5)]
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    step = lower(
        PackedTicks.one_op_per_tick(sched, 5),
        fns,
        xent,
        mesh_of(D, P),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt),
    )
    assert step._low.step_plan.updates.sum() >= P  # optimizer steps inside the loop
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    ref, want = unpipelined_training(fns, params, opt, batches)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    assert_trees_close(got, ref)


@pytest.mark.parametrize(
    "kind, D, P, v, failed",
    [("zb-h2", 2, 4, 1, ()), ("interleaved-1f1b", 2, 2, 2, ()), ("1f1b", 4, 2, 1, ((2, 1),))],
    ids=["zb-h2-2x4", "interleaved-2x2", "1f1b-4x2-rerouted"],
)
def test_a_staggered_device_reduces_its_gradients_only_at_its_own_steps(
    monkeypatch, kind, D, P, v, failed
):
    """Every holder of a stage steps it in the same tick, so a device reduces a
    chunk's gradients over the replicas (a psum, or a chain of ppermutes on a mesh
    with a failed worker) only at that chunk's step, not at every stage's step
    (which multiplied the reduction traffic by the number of stages). On a mesh
    with a failed worker every device runs the tick's chain (one set of
    ppermutes), but only the stepping positions' holders are in it. Counted at
    run time: a callback inside the reduction."""
    import jax

    from pjit_pipe.lowering.comms.topology import SURVIVOR_AXIS, Topology

    calls: list[int] = []  # the position of each device whose gradients a reduction sums
    shapes: set[tuple[int, ...]] = set()  # what was reduced
    plain = Topology.reduce_over_replicas

    def counted(self, tree, positions=None):
        shapes.update(leaf.shape for leaf in jax.tree.leaves(tree))
        if self.complete:
            pos = jax.lax.axis_index("stage")
        else:  # the survivors are one flat axis
            pos = jnp.asarray(self.positions)[jax.lax.axis_index(SURVIVOR_AXIS)]
        summed = jnp.isin(pos, jnp.asarray(positions)) if positions is not None else True
        jax.debug.callback(lambda p, s: calls.extend([int(p)] * bool(s)), pos, summed)
        return plain(self, tree, positions)

    monkeypatch.setattr(Topology, "reduce_over_replicas", counted)
    iterations = 2
    if failed:
        sched = schedule_with_failures(kind, P, M, D, failed, time_limit=1.0)
    else:
        sched = stagger(make_schedule(kind, P, M, chunks=v, replicas=D))
    fns, params = tiny_model(P * v)
    opt = optax.sgd(0.1)
    batches = [batch(D * M * MB, seed=50 + i) for i in range(iterations)]
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    step = lower(
        PackedTicks.one_op_per_tick(sched, iterations),
        fns,
        xent,
        mesh_of(D, P),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt),
    )
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    jax.effects_barrier()
    # The stages step in several ticks, so reducing at every update tick would make a
    # call per device and update tick; each live device reduces each chunk once an
    # iteration.
    assert int(np.count_nonzero(step._low.step_plan.updates)) > iterations
    live = [w.stage for w in sched.alive_workers]
    assert sorted(calls) == sorted(p for p in live for _ in range(v * iterations))
    assert all(len(shape) == 1 for shape in shapes)  # one chunk's row, not all v
    ref, want = unpipelined_training(fns, params, opt, batches)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    assert_trees_close(got, ref)
