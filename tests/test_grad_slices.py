"""ZeRO's gradient sum in slices (`grad_sum="slices"`): each W's gradient is
reduce-scattered over 'data' as it is made, inside its cond, into float32
slices, instead of one whole accumulator reduce-scattered after the loop.

Training equals plain `jax.value_and_grad` + optax with a global-norm clip on
the schedule kinds (one and two chunks per device, split backward), at ZeRO 1
and 3 and with weights split over 'tensor'; XLA's compiled temporaries fall by
the accumulator's bytes less a slice's, as the memory report predicts; a
failure and rejoin keep the fault-free losses; what cannot be built (tied
weights) or means nothing (no ZeRO) is refused by name. `grad_sum=
"slices-compute"` reduce-scatters a bf16 model's gradients in bf16: its losses
stay within bf16 rounding of the float32 sums'.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_compute_dtype import collective_dtypes
from test_memory_report import COMPILED_TOLERANCE
from test_zero3 import cli_losses
from test_zero_combos import BATCH, check, optimizer, problem

import pjit_pipe as pp
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.llama import Llama, LlamaConfig
from tests.tiers import EXHAUSTIVE


@pytest.mark.parametrize(
    ("model", "kind", "mesh", "zero", "how"),
    [
        ("mlp", "1f1b", (4, 2, 1), 1, "slices"),
        ("mlp", "zb-h1", (4, 2, 1), 3, "slices"),
        ("mlp", "1f1b", (2, 2, 1), 3, "slices-compute"),  # float32: the same sums
        pytest.param("mlp", "interleaved-1f1b", (4, 2, 1), 3, "slices", marks=pytest.mark.slow),
        pytest.param("mlp", "zb-v", (2, 2, 1), 1, "slices", marks=pytest.mark.slow),
        pytest.param("llama", "1f1b", (2, 2, 2), 3, "slices", marks=pytest.mark.slow),
        pytest.param("llama", "zb-h2", (4, 2, 1), 3, "slices", marks=EXHAUSTIVE),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_slices_train_like_optax(model, kind, mesh, zero, how):
    """Three clipped adamw steps equal optax's (1e-5): the slices hold the same sums."""
    check(model, kind, mesh, zero, "adamw", grad_sum=how)


def three_losses(pm, batch) -> list[float]:
    """The losses of three steps of `pm` on `batch` (an LM's tokens and targets)."""
    step = pm.train_step(lm_loss)
    state = step.init(pm.init(jax.random.key(0), batch[0]), batch)
    losses = []
    for _ in range(3):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return losses


@pytest.mark.slow
def test_bf16_slices_reduce_in_bf16_within_its_rounding():
    """A bf16 GPT at 4x2, ZeRO-3: with "slices-compute" the program jax hands XLA
    reduce-scatters bf16 rows (with "slices" float32 ones only), and its losses stay
    within bf16 rounding of the float32 sums' (those equal zero=0's exactly:
    test_compute_dtype.py)."""
    model = GPT(dataclasses.replace(GPTConfig.tiny(vocab=65), dtype=jnp.bfloat16))
    x = np.random.default_rng(0).integers(0, 65, size=(32, 32)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    losses, scattered = {}, {}
    for how in ("slices", "slices-compute"):
        pm = pp.pipeline(
            model,
            stages=2,
            microbatches=4,
            mesh=pp.make_mesh(data=4, stage=2),
            optimizer=optax.adam(1e-2),
            zero=3,
            grad_sum=how,
        )
        losses[how] = three_losses(pm, batch)
        shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
        scattered[how] = collective_dtypes(pm, shapes, batch, "reduce-scatter")
    assert scattered == {"slices": {"f32"}, "slices-compute": {"bf16", "f32"}}, scattered
    np.testing.assert_allclose(losses["slices-compute"], losses["slices"], rtol=1e-3)
    assert losses["slices-compute"] != losses["slices"]  # the sums did round in bf16


@pytest.mark.slow
def test_bf16_slices_with_weights_split_over_tensor():
    """A bf16 Llama at 2x2x2, ZeRO-3: "slices-compute" reduce-scatters its flat rows
    in bf16 and the buffers split over 'tensor' in float32 (XLA's CPU backend does
    not compile a bf16 reduce-scatter of those), with the accumulator's losses
    within bf16 rounding."""
    config = LlamaConfig.tiny(vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    model = Llama(dataclasses.replace(config, dtype=jnp.bfloat16))
    x = np.random.default_rng(0).integers(0, 64, size=(16, 32)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    losses = {}
    for how in ("accumulator", "slices-compute"):
        pm = pp.pipeline(
            model,
            stages=2,
            microbatches=4,
            mesh=pp.make_mesh(data=2, stage=2, tensor=2),
            optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
            zero=3,
            grad_sum=how,
        )
        losses[how] = three_losses(pm, batch)
    np.testing.assert_allclose(losses["slices-compute"], losses["accumulator"], rtol=1e-3)


def _gpt_reports(D: int, P: int) -> dict[str, object]:
    config = GPTConfig.tiny(vocab=65)
    x = np.random.default_rng(0).integers(0, 65, size=(8 * D, config.seq_len)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    reports = {}
    for how in ("accumulator", "slices"):
        pm = pp.pipeline(
            GPT(config),
            stages=P,
            microbatches=4,
            mesh=pp.make_mesh(data=D, stage=P),
            optimizer=optax.adam(1e-3),
            zero=1,
            grad_sum=how,
        )
        shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
        reports[how] = pm.memory_report(shapes, batch, lm_loss, compiled=True)
    return reports


def test_slices_compile_to_fewer_temporaries_as_the_report_predicts():
    """Tiny GPT, 4x2, ZeRO-1: XLA's temporaries fall by at least 3/4 of what the
    report says the accumulator costs over the slices, and each report's total is
    within the suite's tolerance of XLA's peak."""
    reports = _gpt_reports(4, 2)
    whole, sliced = reports["accumulator"], reports["slices"]
    saved = whole.largest().grads - sliced.largest().grads
    assert saved > 0
    drop = whole.compiled["compiled_temporaries"] - sliced.compiled["compiled_temporaries"]
    assert drop >= 0.75 * saved, (drop, saved)
    for report in (whole, sliced):
        assert abs(report.largest().total / report.compiled["compiled_peak"] - 1) <= (
            COMPILED_TOLERANCE
        )


def test_grad_sum_refusals_name_the_option():
    module = problem("mlp")[0]
    mesh = pp.make_mesh(data=2, stage=2)
    with pytest.raises(pp.OptionError, match=r"grad_sum: expected one of accumulator, slices"):
        pp.pipeline(module, stages=2, microbatches=2, mesh=mesh, zero=1, grad_sum="each")
    with pytest.raises(pp.OptionError, match=r"grad_sum='slices' .* set zero=1 or zero=3"):
        pp.pipeline(module, stages=2, microbatches=2, mesh=mesh, grad_sum="slices")
    tied, tied_boxed, tied_loss, tied_batches = problem("tied-gpt2")
    pm = pp.pipeline(
        tied,
        stages=2,
        microbatches=BATCH // 4,
        mesh=mesh,
        optimizer=optimizer("sgd", clip=False),
        zero=1,
        grad_sum="slices",
    )
    with pytest.raises(pp.OptionError, match=r"grad_sum='slices' with tied parameters"):
        step = pm.train_step(tied_loss)
        step(step.init(tied_boxed, tied_batches[0]), tied_batches[0])


@pytest.mark.slow
def test_cli_slices_keep_the_accumulators_losses_through_a_failure(capsys):
    """`pjit-pipe train --zero 3 --grad-sum slices` with worker (1, 0) down from step
    1 to 3 (its variant sums without ZeRO) gives the accumulator's losses."""
    argv = ["train", "--model", "mlp", "--mesh", "4x2", "--steps", "4", "--json", "--zero", "3"]
    argv += ["--fail", "1:1:0", "--rejoin", "3:1:0"]
    how = ("accumulator", "slices")
    losses = {h: cli_losses(capsys, [*argv, "--grad-sum", h]) for h in how}
    assert len(losses["slices"]) == 4
    np.testing.assert_allclose(losses["slices"], losses["accumulator"], rtol=1e-5)


def test_cli_memory_prices_both_sums(capsys):
    """`pjit-pipe memory --grad-sum slices` prices the slices alone: the gradient part
    falls from the accumulator and its slice to two slices (D = 4)."""
    from pjit_pipe.cli import main

    argv = ["memory", "--model", "gpt-tiny", "--mesh", "4x2", "--zero", "1", "--json"]
    grads = {}
    for how in ("accumulator", "slices"):
        assert main([*argv, "--grad-sum", how]) == 0
        grads[how] = json.loads(capsys.readouterr().out)["grads"]
    assert grads["slices"] * 5 == grads["accumulator"] * 2  # 2/D of (1 + 1/D) rows
