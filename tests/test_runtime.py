"""Training through failures: injected failures and rejoins, variants, the detector.

The reference is plain unpipelined training (jax.value_and_grad + optax adam)
on the same batches: a run with a failure at step 5 and a rejoin at step 12
must have its loss at every step.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.ir.failures import enumerate_patterns
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.runtime import (
    InjectedFailures,
    ResilientTrainer,
    Variants,
    WorkerFailure,
)
from tests.tiers import EXHAUSTIVE

STEPS, M, BATCH = 20, 4, 32
MODEL = ResidualMLP(d_model=16, hidden=16, n_layers=4, d_out=4)


def batches(n: int = STEPS) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = rng.normal(size=(BATCH, 8)).astype(np.float32)
        out.append((x, np.sin(x[:, :4])))
    return out


@pytest.fixture(scope="module")
def reference():
    """Loss per step of unpipelined adam training, and the initial params."""
    data = batches()
    params = MODEL.init(jax.random.key(0), data[0][0])
    return params, np.array(optax_losses(MODEL, params, optax.adam(1e-2), data))


def optax_losses(model, params, opt, data) -> list[float]:
    """The loss of each step of plain `jax.value_and_grad` + `opt` training of
    `model` (mse) from `params` on the (x, y) batches of `data`."""

    @jax.jit
    def step(params, state, x, y):
        loss, g = jax.value_and_grad(lambda p: mse_loss(model.apply(p, x), y))(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    p, s, losses = params, opt.init(params), []
    for x, y in data:
        p, s, loss = step(p, s, x, y)
        losses.append(float(loss))
    return losses


def trainer(D: int, P: int, kind: str, detector=None, on_event=None) -> ResilientTrainer:
    pm = pp.pipeline(
        MODEL,
        stages=P,
        microbatches=M,
        schedule=kind,
        mesh=pp.make_mesh(data=D, stage=P),
        optimizer=optax.adam(1e-2),
    )
    return ResilientTrainer(pm, mse_loss, detector, on_event=on_event)


# A middle stage of a 2x4 mesh (1f1b), the first stage of a 4x2 mesh (zb-h1),
# and two failures at different steps on 4x2 (the first of them the one before,
# so that case runs only when asked).
CASES = [
    pytest.param("1f1b", 2, 4, {5: [(0, 2)]}, {12: [(0, 2)]}, id="1f1b-2x4-1fail"),
    pytest.param(
        "zb-h1", 4, 2, {5: [(0, 0)]}, {12: [(0, 0)]}, marks=EXHAUSTIVE, id="zb-h1-4x2-1fail"
    ),
    pytest.param(
        "zb-h1", 4, 2, {5: [(0, 0)], 8: [(2, 1)]}, {12: [(0, 0), (2, 1)]}, id="zb-h1-4x2-2fail"
    ),
]


@pytest.mark.parametrize("kind,D,P,fail,rejoin", CASES)
def test_loss_unbroken_through_failure_and_rejoin(reference, kind, D, P, fail, rejoin):
    """The failed devices' rows of the state are overwritten with NaN (-1 for
    integers) the moment they fail, so a switch or rejoin that read them would
    break the loss; it must stay unbroken."""
    params, want = reference
    current = {}

    def poison(buf, dead):
        def row(shard):
            if shard.device not in dead:
                return shard.data
            bad = np.nan if np.issubdtype(buf.dtype, np.floating) else -1
            return jax.device_put(np.full(shard.data.shape, bad, buf.dtype), shard.device)

        rows = [row(s) for s in buf.addressable_shards]
        return jax.make_array_from_single_device_arrays(buf.shape, buf.sharding, rows)

    def lose_failed_devices(event):
        if event.kind == "failure":
            mesh = tr.pipelined.mesh
            dead = {mesh.devices[w.replica, w.stage, 0] for w in event.failed}
            state = current["state"]  # the state the trainer retries from
            for bufs in (state.device_params, state.device_opt):
                bufs.update({k: poison(b, dead) for k, b in bufs.items()})

    tr = trainer(D, P, kind, InjectedFailures(fail, rejoin), lose_failed_devices)
    data = batches()
    state = tr.init(params, data[0], precompile=False)
    row_bytes = sum(b.nbytes // (D * P) for b in jax.tree.leaves(state))
    got = []
    for batch in data:
        current["state"] = state
        state, loss = tr.step(state, batch)
        got.append(float(loss))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert state.step == STEPS  # every step applied once: no retry was committed twice
    failures = [e for e in tr.events if e.kind == "failure"]
    assert [e.step for e in failures] == sorted(fail)
    switches = [(e.step, e.failed) for e in tr.events if e.kind == "switch"]
    down, expect, moved = frozenset(), [], []
    for step in sorted({*fail, *rejoin}):
        back = {Worker(*w) for w in rejoin.get(step, ())}
        down = (down | {Worker(*w) for w in fail.get(step, ())}) - back
        expect.append((step, down))
        moved.append(len(back) * row_bytes)  # survivors keep their rows; a rejoin copies one
    assert switches == expect
    assert [e.bytes_moved for e in tr.events if e.kind == "switch"] == moved
    # the committed state lives on the full mesh again after the rejoin
    for buffer in state.device_params.values():
        assert set(buffer.sharding.device_set) == set(tr.pipelined.mesh.devices.flat)


class UncheckedPlan:
    """A detector whose failures the trainer cannot know ahead (as LiveDevices')."""

    def __init__(self, plan: InjectedFailures):
        self.plan = plan

    def attempt(self, step: int):
        return self.plan.attempt(step)


def test_unrecoverable_failure_names_the_stage_and_keeps_the_state(reference):
    params, _ = reference
    plan = InjectedFailures({1: [(0, 3), (1, 3)]})
    with pytest.raises(pp.FailurePlanError, match="every replica of stage 3 is down"):
        trainer(2, 4, "1f1b", plan)  # an injected plan is checked when the trainer is built
    tr = trainer(2, 4, "1f1b", UncheckedPlan(plan))
    data = batches(2)
    state = tr.init(params, data[0], precompile=False)
    state, _ = tr.step(state, data[0])
    before = jax.tree.map(np.asarray, state)
    with pytest.raises(ScheduleError, match="stage 3"):
        tr.step(state, data[1])
    assert state.step == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)


def test_precompiled_variants_cover_every_single_failure(reference):
    params, _ = reference
    tr = trainer(2, 2, "1f1b")
    data = batches(1)
    state = tr.init(params, data[0], precompile=False)
    variants: Variants = tr.variants
    done = []
    variants.precompile(max_failures=1, background=True, on_done=done.append)
    variants.wait()
    singles = [frozenset({Worker(r, s)}) for r in range(2) for s in range(2)]
    assert {v.failed for v in done} == set(singles)  # the fault-free one was compiled by init
    assert set(variants.compiled) == {frozenset(), *singles}
    assert all(variants.ready(f) for f in singles)
    # every variant computes the same step as the fault-free program
    _, loss0 = variants.get(())(state, data[0])
    for failed in singles:
        _, loss = variants.get(failed)(state, data[0])
        np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6)


def test_every_recoverable_failure_set_is_listed():
    sets = [p.failed for p in enumerate_patterns(2, 2, 2, canonical=False)]
    assert sets[0] == frozenset() and len(sets) == 1 + 4 + 4  # two-failure sets: 6 - 2 lethal
    assert frozenset({Worker(0, 1), Worker(1, 1)}) not in sets


def test_injected_failures_lose_one_attempt_then_hold():
    det = InjectedFailures({3: [(1, 2)]}, {6: [(1, 2)]})
    with det.attempt(2) as down:
        assert down == frozenset()
    with pytest.raises(WorkerFailure, match="1:2"), det.attempt(3) as down:
        assert down == frozenset()
    with det.attempt(3) as down:  # the retry sees the failure and succeeds
        assert down == {Worker(1, 2)}
    with det.attempt(6) as down:
        assert down == frozenset()


def test_the_planned_failure_sets_are_the_ones_the_attempts_meet():
    plan = {"fail": {2: [(0, 1)], 4: [(1, 0)], 7: [(0, 0)]}, "rejoin": {5: [(0, 1)], 9: [(1, 0)]}}
    met: list[frozenset] = []
    det = InjectedFailures(**plan)
    for step in range(11):
        while True:  # each step retried until an attempt holds, as the trainer does
            try:
                with det.attempt(step) as down:
                    if down and down not in met:
                        met.append(down)
                break
            except WorkerFailure:
                continue
    assert InjectedFailures(**plan).planned() == met
    assert met[0] == {Worker(0, 1)} and {Worker(0, 1), Worker(1, 0)} in met
