"""The memory report predicts what each device holds, before anything is allocated.

- Its state (parameters and optax state) is exactly what a real `step.init`
  state holds per device (`state.device_bytes()`), without and with ZeRO-1, on
  two meshes, from `jax.eval_shape` shapes only.
- Its total is within `COMPILED_TOLERANCE` of XLA's peak for the compiled step,
  and `device_memory_analysis` reads that compiled step.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.errors import OptionError
from pjit_pipe.models import GPT, GPTConfig, ResidualMLP, lm_loss, mse_loss

# The report's total against XLA's compiled peak (arguments, temporaries and the
# outputs that reuse no argument): the residual pools, messages and state are
# counted exactly, the ops' working intermediates estimated.
COMPILED_TOLERANCE = 0.10


def mlp_pipeline(D: int, P: int, zero: bool):
    model = ResidualMLP(n_layers=4, d_model=32, hidden=64)
    x = np.random.default_rng(0).normal(size=(2 * D * 4, 16)).astype(np.float32)
    y = np.sin(x[:, :8])
    pm = pp.pipeline(
        model,
        stages=P,
        microbatches=4,
        schedule="1f1b",
        mesh=pp.make_mesh(data=D, stage=P),
        optimizer=optax.adam(1e-3),
        zero=zero,
    )
    return pm, x, y


@pytest.mark.parametrize("D,P", [(2, 2), (4, 2)], ids=["2x2", "4x2"])
@pytest.mark.parametrize("zero", [False, True], ids=["zero0", "zero1"])
def test_predicted_state_is_what_init_holds(D, P, zero):
    pm, x, y = mlp_pipeline(D, P, zero)
    shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
    report = pm.memory_report(shapes, (x, y), mse_loss)
    assert (report.data, report.stages, report.zero) == (D, P, int(zero))
    state = pm.train_step(mse_loss).init(pm.init(jax.random.key(0), x), (x, y))
    held = state.device_bytes()
    mesh = pm.mesh.devices[..., 0]
    for p, predicted in enumerate(report.devices):
        assert predicted.stage == p
        for r in range(D):
            assert predicted.state == held[mesh[r, p]], (r, p)
    if zero:  # each replica holds its slice of adam's state and its neighbour's: 2/D
        whole = pm.memory_report(shapes, (x, y), mse_loss, zero=0).devices[0]
        assert report.devices[0].optimizer < whole.optimizer * (2 / D + 0.01)


def test_report_within_tolerance_of_compiled_step():
    config = GPTConfig.tiny(vocab=65)
    x = np.random.default_rng(0).integers(0, 65, size=(32, config.seq_len)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    pm = pp.pipeline(
        GPT(config),
        stages=2,
        microbatches=4,
        schedule="zb-h1",
        mesh=pp.make_mesh(data=2, stage=2),
        optimizer=optax.adam(1e-3),
    )
    shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
    report = pm.memory_report(shapes, (x, y), lm_loss, compiled=True)
    peak = report.compiled["compiled_peak"]
    total = report.largest().total
    assert abs(total / peak - 1) <= COMPILED_TOLERANCE, (total, report.compiled)
    # the activations (residual pools) are most of this step: they are counted
    assert report.largest().activations > 0.3 * peak
    # and what the report compiled is the step that device_memory_analysis reads
    _, program = pm.program(shapes, x, y, lm_loss)
    analysis = program.device_memory_analysis()
    assert analysis.temp_size_in_bytes == report.compiled["compiled_temporaries"]
    assert report.as_dict(device_memory=peak)["fits"] is (total <= peak)


def test_device_memory_analysis_after_train_step_compile():
    pm, x, y = mlp_pipeline(2, 2, False)
    step = pm.train_step(mse_loss)
    params = pm.init(jax.random.key(0), x)
    state = step.init(params, (x, y))
    _, program = pm.program(params, x, y, mse_loss)
    with pytest.raises(ValueError, match="compile_device_train_step"):
        program.device_memory_analysis()
    step.compile(state, (x, y))
    analysis = program.device_memory_analysis()
    # the step's arguments hold at least the state it takes
    assert analysis.argument_size_in_bytes >= max(state.device_bytes().values())
    with pytest.raises(ValueError, match="donate=False"):
        program.device_memory_analysis(donate=False)


def test_report_refuses_bad_zero_and_compiled_elsewhere():
    pm, x, y = mlp_pipeline(2, 2, False)
    shapes = jax.eval_shape(pm.init, jax.random.key(0), x)
    with pytest.raises(OptionError, match="zero: expected one of 0, 1, 3"):
        pm.memory_report(shapes, (x, y), mse_loss, zero=2)
    with pytest.raises(OptionError, match="compiled=True"):
        pm.memory_report(shapes, (x, y), mse_loss, data=4, compiled=True)


def test_cli_prices_llama3_8b_from_shapes(capsys):
    from pjit_pipe.cli import main

    argv = ["memory", "--model", "llama", "--config", "8b", "--mesh", "4x4", "--seq", "1024"]
    reports = {}
    for zero in (0, 1, 3):
        assert main([*argv, "--zero", str(zero), "--device-memory", "80GB", "--json"]) == 0
        reports[zero] = json.loads(capsys.readouterr().out)
    whole = reports[0]
    assert whole["mesh"] == [4, 4, 1] and whole["device_memory"] == 80 * 10**9
    # Llama-3-8B's parameters, counted from its published shapes
    d, f, kv, vocab, layers = 4096, 14336, 8 * 128, 128256, 32
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    n = layers * per_layer + 2 * vocab * d + d
    # adam keeps two moments per parameter: each stage's own share sums to 3x the model
    own = sum(device["own_state"] for device in whole["devices"])
    assert abs(own / (3 * 4 * n) - 1) < 1e-6
    for device in whole["devices"]:  # every device pays for the largest stage
        assert 3 * device["params"] >= device["own_state"] - 16  # (adam's step counts)
        assert device["total"] == whole["total"]
    # ZeRO-1 keeps 2/D of the optax state, ZeRO-3 2/D of the parameters too
    assert reports[1]["optimizer"] == pytest.approx(whole["optimizer"] / 2, rel=1e-3)
    assert reports[1]["params"] == whole["params"]
    assert reports[3]["params"] == pytest.approx(whole["params"] / 2, rel=1e-3)
    # gathered whole for the step, in bf16: every weight is read through a cast to
    # bf16, only the RMSNorm scales (2 per layer and 1, a 1e-4 share) in float32
    assert reports[3]["gathered"] == pytest.approx(whole["params"] / 2, rel=1e-3)
    assert reports[0]["total"] > reports[1]["total"] > reports[3]["total"]
    assert all(r["fits"] is (r["total"] <= 80 * 10**9) for r in reports.values())


@pytest.mark.slow
def test_cli_fits_llama3_70b_at_zero3_with_bf16_slices(capsys):
    """Llama-3-70B on 8x8, 4096 tokens, remat: ZeRO-3 fits 80 GB only when the
    gradients are summed in slices reduce-scattered in bf16: a W then holds its bf16
    stage gradient (the gathered rows' bytes) and a 1/D slice of it, where the
    accumulator holds a float32 row of the stage and its slice."""
    from pjit_pipe.cli import main

    argv = ["memory", "--model", "llama", "--config", "70b", "--mesh", "8x8", "--zero", "3"]
    argv += ["--seq", "4096", "-m", "8", "--remat", "--device-memory", "80GB", "--json"]
    reports = {}
    for how in ("accumulator", "slices-compute"):
        assert main([*argv, "--grad-sum", how]) == 0
        reports[how] = json.loads(capsys.readouterr().out)
    whole, sliced = reports["accumulator"], reports["slices-compute"]
    assert sliced["workspace"] == sliced["gathered"] + sliced["gathered"] // 8
    assert sliced["grads"] == sliced["params"]  # two float32 slices, as the state's
    assert whole["grads"] == 4 * sliced["params"] + sliced["params"] // 2  # D/2 + 1/2
    assert sliced["fits"] and not whole["fits"]


def test_cli_refuses_config_of_another_model(capsys):
    from pjit_pipe.cli import main

    assert main(["memory", "--model", "mlp", "--config", "70b"]) == 2
    assert "only --model llama" in capsys.readouterr().err


def test_zero_levels_by_name():
    mesh = pp.make_mesh(data=2, stage=2)
    options = lambda zero: pp.PipelineOptions(stages=2, microbatches=2, mesh=mesh, zero=zero)  # noqa: E731
    assert options(True).zero == options(1).zero == 1  # zero=1 names zero=True
    assert options(False).zero == options(0).zero == 0
    assert options(3).zero == 3
    for bad in (2, "yes", 1.0):
        with pytest.raises(OptionError, match=r"zero: expected 0 \(False\), 1 .* or 3"):
            options(bad)


def test_cutting_by_flops_and_parameters_pads_every_device_less():
    """A Llama whose embedding and head outweigh its blocks, at P=4: cut by FLOPs,
    the embedding's stage is the largest and every device is padded to it; cut by
    the worse of FLOPs and parameters, the largest device's state over the mean
    own state falls, and so does that worse share (what the cut minimises)."""
    from pjit_pipe.models.llama import Llama, LlamaConfig
    from pjit_pipe.models.llama import lm_loss as llama_loss

    config = LlamaConfig.tiny(vocab=2048, n_layers=8, tensor_parallel=False)
    tokens = jax.ShapeDtypeStruct((8, config.seq_len), np.int32)
    padding, worst = {}, {}
    for balance in ("flops", "flops+params"):
        pm = pp.pipeline(
            Llama(config),
            stages=4,
            microbatches=2,
            optimizer=optax.adam(1e-3),
            balance=balance,
            mesh=pp.make_mesh(data=1, stage=4),
        )
        shapes = jax.eval_shape(pm.module.init, jax.random.key(0), tokens)
        report = pm.memory_report(shapes, (tokens, tokens), llama_loss)
        own = np.array([d.own_state for d in report.devices], float)
        flops = np.array(pm.cut(shapes, tokens).flops)
        padding[balance] = report.largest().state / own.mean()
        worst[balance] = max(own.max() / own.mean(), flops.max() / flops.mean())
    assert padding["flops+params"] < padding["flops"] - 0.2, padding
    assert worst["flops+params"] < worst["flops"], worst
