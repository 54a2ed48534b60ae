"""Failures on a three-axis mesh: a (replica, stage) group of tensor=2 devices
fails under ZeRO, on the bundled Llama (an `nn.scan` stack with Megatron
annotations), untied and with its embedding tied to the head. The losses and
the final parameters equal the run without failures, and a rejoin restores the
exact state (the run goes on from it with the fault-free numbers)."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.models.llama import Llama, LlamaConfig, lm_loss
from tests.numerics import rel_err
from tests.test_tensor_zero import poisoned
from tests.test_zero_combos import problem
from tests.tiers import EXHAUSTIVE

STEPS = 5
FAIL_AT, REJOIN_AT = 1, 3


def batches(config: LlamaConfig) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for k in jax.random.split(jax.random.key(3), STEPS):
        tokens = jax.random.randint(k, (8, config.seq_len + 1), 0, config.vocab)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def run(model: Llama, boxed, data, failing: bool) -> tuple[list[float], object, list]:
    """Losses, final params and the trainer's switches of a run on 2x2x2 with ZeRO,
    where worker (1, 0) (its two tensor devices) fails and later rejoins when
    `failing`; the failed devices' rows turn to NaN, so reading them would show."""
    pm = pp.pipeline(
        model,
        stages=2,
        microbatches=2,
        mesh=pp.make_mesh(data=2, stage=2, tensor=2),
        optimizer=optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-3)),
        zero=True,
    )
    fail = {FAIL_AT: [(1, 0)]} if failing else {}
    rejoin = {REJOIN_AT: [(1, 0)]} if failing else {}
    current = {}

    def lose_failed_devices(event, devices=pm.mesh.devices):
        if event.kind == "failure":
            dead = {d for w in event.failed for d in devices[w.replica, w.stage].flat}
            state = current["state"]
            for bufs in (state.device_params, state.device_opt):
                bufs.update({k: poisoned(b, dead) for k, b in bufs.items()})

    trainer = pp.ResilientTrainer(
        pm, lm_loss, pp.InjectedFailures(fail, rejoin), on_event=lose_failed_devices
    )
    state = trainer.init(boxed, data[0], precompile=False)
    losses = []
    for batch in data:
        current["state"] = state
        state, loss = trainer.step(state, batch)
        losses.append(float(loss))
    switches = [(e.step, sorted(e.failed)) for e in trainer.events if e.kind == "switch"]
    return losses, nn.meta.unbox(state.params), switches


@pytest.mark.slow
# Tied weights through a failure: test_cutter.py's tied LM.
@pytest.mark.parametrize(
    "tied", [False, pytest.param(True, marks=EXHAUSTIVE)], ids=["scan", "scan-tied"]
)
def test_a_failed_tensor_group_under_zero_keeps_the_fault_free_numbers(tied):
    model, boxed, *_ = problem("tied-llama" if tied else "llama")
    data = batches(model.config)
    clean_losses, clean_params, clean_switches = run(model, boxed, data, failing=False)
    losses, params, switches = run(model, boxed, data, failing=True)
    assert clean_switches == []
    assert switches == [(FAIL_AT, [(1, 0)]), (REJOIN_AT, [])], switches
    np.testing.assert_allclose(losses, clean_losses, rtol=1e-5)
    assert rel_err(params, clean_params) <= 1e-5
