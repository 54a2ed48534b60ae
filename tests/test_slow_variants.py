"""Slow-worker variants: compiled ahead for a plan, one program per replica permutation."""

import jax
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.frontend import worker_devices
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.ops import Kind, Worker
from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.runtime import InjectedSlowdowns, ResilientTrainer
from tests.test_runtime import optax_losses


def mlp_and_optax_losses(seed: int):
    """(model, params, adam, 6 batches, the losses of plain value_and_grad + optax
    steps on them) for the trainer tests of slow workers."""
    model = ResidualMLP(d_model=16, hidden=16, n_layers=4, d_out=4)
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(6):
        x = rng.normal(size=(16, 8)).astype(np.float32)
        data.append((x, np.sin(x[:, :4])))
    params = model.init(jax.random.key(0), data[0][0])
    opt = optax.adam(1e-2)
    return model, params, opt, data, optax_losses(model, params, opt, data)


def test_replica_permutations_of_slow_workers_have_one_canonical_form():
    # Worker 1:1 or 0:1 at factor 2 on a 2x2 mesh: the same pattern up to relabelling.
    forms = set()
    for r in range(2):
        canon, perm = FailurePattern(2, 2).canonical({(r, 1): 2.0})
        assert canon.failed == frozenset() and sorted(perm) == [0, 1]
        forms.add(perm[r])  # the canonical replica of the slow worker
    assert forms == {0}
    # Another factor or stage is another pattern; failures still order replicas first.
    _, perm = FailurePattern(3, 2, frozenset({Worker(2, 0)})).canonical({(1, 1): 3.0})
    assert perm[2] == 0 and perm[1] == 1


def test_injected_slowdowns_plan_the_slow_sets_in_order():
    plan = InjectedSlowdowns({5: {(0, 1): 2.0}, 9: {(0, 1): 1.0}, 12: {(1, 0): 3.0}, 14: {}})
    assert plan.planned() == [{Worker(0, 1): 2.0}, {Worker(1, 0): 3.0}]


@pytest.mark.slow
def test_planned_slow_patterns_compile_ahead_and_permutations_share_a_program():
    model, params, opt, data, want = mlp_and_optax_losses(seed=1)

    pm = pp.pipeline(
        model, stages=2, microbatches=4, mesh=pp.make_mesh(data=2, stage=2), optimizer=opt
    )
    plan = {2: {(1, 1): 2.0}, 4: {(1, 1): 1.0, (0, 1): 2.0}}  # 1:1 slow, then 0:1 instead
    tr = ResilientTrainer(
        pm, mse_loss, speeds=InjectedSlowdowns(plan), max_failures=0, slow_factors=()
    )
    state = tr.init(params, data[0])  # the plan's two patterns compile in the background
    tr.variants.wait()
    got = []
    for batch in data:
        state, loss = tr.step(state, batch)
        got.append(float(loss))
    tr.close()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert [e.kind for e in tr.events] == ["switch", "switch"]  # no wait: compiled ahead
    assert [(e.step, e.slow) for e in tr.events] == [
        (2, ((Worker(1, 1), 2.0),)),
        (4, ((Worker(0, 1), 2.0),)),
    ]
    assert all(e.bytes_moved == 0 for e in tr.events)  # replicas hold the same rows

    variants = tr.variants.mitigated
    assert len(variants) == 2
    a, b = variants.values()
    assert a.pipelined.schedule == b.pipelined.schedule  # one program for both patterns
    devices = worker_devices(pm.mesh)
    for v in (a, b):
        # The slow device runs fewer forward slices of stage 1 than its peer.
        ((slow_worker, _),) = v.slow
        rows = worker_devices(v.pipelined.mesh)
        forwards = {}
        for w, program in v.pipelined.schedule.programs.items():
            if w.stage == 1:
                device = rows[w.replica, 1, 0]
                forwards[device] = sum(op.kind == Kind.F for op in program)
        slow_device = devices[slow_worker.replica, 1, 0]
        assert forwards[slow_device] < min(n for d, n in forwards.items() if d != slow_device)
