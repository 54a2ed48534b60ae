"""ZeRO's gradient sum in slices (`grad_sum="slices"`): each W's gradient is
reduce-scattered over 'data' as it is made, inside its cond, into float32
slices, instead of one whole accumulator reduce-scattered after the loop.

Training equals plain `jax.value_and_grad` + optax with a global-norm clip on
the schedule kinds (one and two chunks per device, split backward), at ZeRO 1
and 3 and with weights split over 'tensor'; XLA's compiled temporaries fall by
the accumulator's bytes less a slice's, as the memory report predicts; a
failure and rejoin keep the fault-free losses; what cannot be built (tied
weights) or means nothing (no ZeRO) is refused by name.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
from test_memory_report import COMPILED_TOLERANCE
from test_zero3 import cli_losses
from test_zero_combos import BATCH, check, optimizer, problem

import pjit_pipe as pp
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from tests.tiers import EXHAUSTIVE


@pytest.mark.parametrize(
    ("model", "kind", "mesh", "zero"),
    [
        ("mlp", "1f1b", (4, 2, 1), 1),
        ("mlp", "zb-h1", (4, 2, 1), 3),
        pytest.param("mlp", "interleaved-1f1b", (4, 2, 1), 3, marks=pytest.mark.slow),
        pytest.param("mlp", "zb-v", (2, 2, 1), 1, marks=pytest.mark.slow),
        pytest.param("llama", "1f1b", (2, 2, 2), 3, marks=pytest.mark.slow),
        pytest.param("llama", "zb-h2", (4, 2, 1), 3, marks=EXHAUSTIVE),
    ],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_slices_train_like_optax(model, kind, mesh, zero):
    """Three clipped adamw steps equal optax's (1e-5): the slices hold the same sums."""
    check(model, kind, mesh, zero, "adamw", grad_sum="slices")


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
