"""Parameters in their compute dtype, and a model's own remat, through the pipeline.

- A leaf whose one use is a cast to bf16 is handed to the stage cast (its
  gradient then comes back with the same values), and ZeRO-3 all-gathers it in
  bf16: the gathered rows are half the bytes, the numbers those of zero=0.
- A stage that checkpoints its own layers (the Llama's `nn.remat` blocks)
  stores only the layers' inputs: the stage policy does not override the
  model's remat, and the memory report counts one layer's recomputation.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS
from test_memory_report import COMPILED_TOLERANCE

import pjit_pipe as pp
from pjit_pipe.lowering.compute.compute_dtype import compute_dtypes
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.llama import Llama, LlamaConfig

BF16 = jnp.dtype(jnp.bfloat16)


def test_a_leaf_qualifies_only_through_one_cast_to_a_narrower_float():
    def fn(p, x):
        h = x @ p["cast"].astype(jnp.bfloat16)  # one use, a cast: qualifies
        h = h * p["plain"]  # used as it is
        h = h + p["twice"].astype(jnp.bfloat16) + p["twice"].astype(jnp.bfloat16)

        def body(c, w):  # a scan's per-iteration slice: qualifies
            return c @ w.astype(jnp.bfloat16) + p["const"].astype(jnp.bfloat16), None

        h, _ = jax.lax.scan(body, h, p["stack"])
        return h, p["count"].astype(jnp.int32)

    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    params = {
        "cast": f32(4, 4),
        "count": f32(4),  # cast to an integer
        "const": f32(4),  # a scan's loop-invariant operand: its cotangent sums in bf16
        "plain": f32(4),
        "stack": f32(3, 4, 4),
        "twice": f32(4),  # two uses: their cotangents would sum in bf16
    }
    got = compute_dtypes(fn, params, jax.ShapeDtypeStruct((2, 4), jnp.bfloat16))
    assert dict(zip(sorted(params), got, strict=True)) == {
        "cast": BF16,
        "const": None,
        "count": None,
        "plain": None,
        "stack": BF16,
        "twice": None,
    }


def _bf16_gpt():
    return GPT(dataclasses.replace(GPTConfig.tiny(vocab=65), dtype=jnp.bfloat16))


@pytest.mark.slow
def test_zero3_gathers_bf16_rows_and_trains_as_zero0():
    """The bf16 GPT at 4x2: zero=3's losses equal zero=0's exactly (the ops see the
    same bf16 values and their gradients convert back exactly), and XLA's compiled
    peak falls by what the report's `gathered` saves against float32 rows."""
    x = np.random.default_rng(0).integers(0, 65, size=(32, 32)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    losses, reports = {}, {}
    for zero in (0, 3):
        pm = pp.pipeline(
            _bf16_gpt(),
            stages=2,
            microbatches=4,
            mesh=pp.make_mesh(data=4, stage=2),
            optimizer=optax.adam(1e-2),
            zero=zero,
        )
        shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
        reports[zero] = pm.memory_report(shapes, batch, lm_loss, compiled=zero == 3)
        step = pm.train_step(lm_loss)
        state = step.init(pm.init(jax.random.key(0), x), batch)
        losses[zero] = []
        for _ in range(2):
            state, loss = step(state, batch)
            losses[zero].append(float(loss))
    assert losses[3] == losses[0]
    rows, gathered = reports[0].largest().params, reports[3].largest().gathered
    # every weight matrix and embedding is read through a cast, the LayerNorms are not
    assert 0.5 * rows < gathered < 0.51 * rows
    # The program jax hands to XLA gathers the cast rows in bf16 (XLA's CPU backend then
    # widens a bf16 all-gather on the wire, and keeps the gathered rows bf16).
    gathers = collective_dtypes(pm, shapes, batch, "all-gather")
    assert "bf16" in gathers and "f32" in gathers, gathers


def collective_dtypes(pm, shapes, batch, collective: str) -> set[str]:
    """The dtypes of `collective` ("all-gather", "reduce-scatter") in the HLO that jax
    hands to XLA for pm's device-layout train step (before XLA's own passes)."""
    _, program = pm.program(shapes, batch[0], batch[1], lm_loss)
    placed = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(pm.device_mesh, PS()))
        for a in batch
    ]
    lowered = program._device_steps[True, True].lower(*program.layout.avals(), *placed)
    pattern = rf"= (\w+)\[[\d,]*\][^=]* {collective}\("
    return set(re.findall(pattern, lowered.as_text("hlo")))


def _llama(dtype=jnp.float32) -> Llama:
    return Llama(
        LlamaConfig.tiny(
            vocab=64,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=128,
            dtype=dtype,
            tensor_parallel=False,
        )
    )


def test_llama_stages_store_only_their_layers_inputs():
    """The Llama's blocks are `nn.remat`: stage 0 keeps its two blocks' inputs and the
    token ids (the embedding's gather), nothing a stage-wide policy would add."""
    model = _llama(jnp.bfloat16)
    x = jax.ShapeDtypeStruct((16, 32), jnp.int32)
    pm = pp.pipeline(model, stages=2, microbatches=4, mesh=pp.make_mesh(data=2, stage=2))
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)
    stages = pm.program(shapes, x, x, lm_loss)[1]._low.st
    mb, d, layers = 16 // (2 * 4), 64, 2
    assert stages.policies[0] == "all"
    assert stages.residual_bytes(0)["b"] == layers * mb * 32 * d * 2 + mb * 32 * 4
    assert stages.region_bytes(0) > stages.residual_bytes(0)["b"]  # one block recomputed


@pytest.mark.slow
@pytest.mark.parametrize(
    ("remat", "grad_sum"),
    [(False, "accumulator"), (True, "accumulator"), (True, "slices")],
    ids=["stored", "remat", "remat-slices"],
)
def test_report_counts_the_models_remat_within_tolerance(remat, grad_sum):
    x = np.random.default_rng(0).integers(0, 64, size=(16, 32)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    pm = pp.pipeline(
        _llama(),
        stages=2,
        microbatches=4,
        mesh=pp.make_mesh(data=2, stage=2),
        optimizer=optax.adam(1e-3),
        zero=3,
        remat=remat,
        grad_sum=grad_sum,
    )
    shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
    report = pm.memory_report(shapes, batch, lm_loss, compiled=True)
    peak = report.compiled["compiled_peak"]
    assert abs(report.largest().total / peak - 1) <= COMPILED_TOLERANCE, report.as_dict()
