"""The training state is sharded by stage: each device holds only its stages' rows.

After two adam steps of the tiny GPT (embedding on the first stage, LM head on
the last: non-uniform stages) every device's state bytes are within 1.15x of
the parameters and optax state of the stages it runs, and the module-layout
view puts each leaf on the devices of the stage that owns it only.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from tests.tiers import EXHAUSTIVE

CONFIG = GPTConfig.tiny(vocab=65)


def leaf_bytes(tree) -> int:
    return sum(
        int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
    )


# 1x4: the 2x4 case holds the same stages, in two replicas
@pytest.mark.parametrize("D,P", [(2, 4), pytest.param(1, 4, marks=EXHAUSTIVE)], ids=["2x4", "1x4"])
def test_each_device_holds_only_its_stage(D, P):
    rng = np.random.default_rng(0)
    x = rng.integers(0, CONFIG.vocab, size=(2 * D * 2, CONFIG.seq_len)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    optimizer = optax.adam(1e-3)
    model = GPT(CONFIG)
    pm = pp.pipeline(
        model, stages=P, microbatches=2, mesh=pp.make_mesh(data=D, stage=P), optimizer=optimizer
    )
    params = pm.init(jax.random.key(0), x)
    step = pm.train_step(lm_loss)
    state = step.init(params, (x, y))
    for _ in range(2):
        state, _ = step(state, (x, y))
    assert state.step == 2

    # The ideal share of each device, from the cut and optax directly.
    cut = pm.cut(params, x)
    stage_params = cut.split(params)
    share = [leaf_bytes(p) + leaf_bytes(optimizer.init(p)) for p in stage_params]
    assert sum(share) > leaf_bytes(params)  # adam's state is counted too
    held = state.device_bytes()
    mesh = pm.mesh.devices[..., 0]
    for r in range(D):
        for s in range(P):
            got = held[mesh[r, s]]
            assert got <= 1.15 * share[s], f"device {r}:{s} holds {got / share[s]:.3f}x its share"
    assert len(held) == D * P

    # The module view: each unit's leaves live on the devices of its stage only.
    view = state.params["params"]
    for s, keys in enumerate(cut.keys):
        for key in keys:
            for leaf in jax.tree.leaves(view[key]):
                assert leaf.sharding.device_set == set(mesh[:, s]), (key, s)
    # and equals what a round trip from that view gives back
    again = step.init(state.params, (x, y), state.opt_state, state.step)
    for a, b in zip(
        jax.tree.leaves((again.device_params, again.device_opt)),
        jax.tree.leaves((state.device_params, state.device_opt)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
