"""ZeRO-3: the parameters between steps sharded over 'data' like the optax state.

Each device holds its slices of its stages' parameters and optax state and a
copy of the next replica's (2/D of the stage's), the step all-gathers the
parameters once, before the tick loop, and reduce-scatters the gradients.
Training equals plain `jax.value_and_grad` + optax (with a global-norm clip)
on every schedule kind; the module view joins the slices, a failed replica's
slices come from its neighbour's copy, and what cannot be built yet (weights
split over 'tensor') is refused by name.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_memory_report import COMPILED_TOLERANCE
from test_tensor_zero import train_losing_failed_rows
from test_zero_combos import BATCH, TOL, check, optax_run, optimizer, problem

import pjit_pipe as pp
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.models.llama import Llama, LlamaConfig
from pjit_pipe.models.llama import lm_loss as llama_loss
from tests.numerics import rel_err
from tests.tiers import EXHAUSTIVE


@pytest.mark.parametrize(
    "kind",
    [
        "1f1b",
        "zb-v",
        pytest.param("zb-h1", marks=pytest.mark.slow),
        pytest.param("interleaved-1f1b", marks=pytest.mark.slow),
        pytest.param("gpipe", marks=pytest.mark.slow),
        pytest.param("zb-h2", marks=EXHAUSTIVE),
    ],
)
def test_zero3_with_a_global_norm_clip_trains_like_optax(kind):
    """Three steps of each kind (its own chunks per device) equal optax's."""
    module, boxed, loss_fn, batches = problem("mlp")
    pm = pp.pipeline(
        module,
        stages=2,
        microbatches=BATCH // 8,
        schedule=kind,
        mesh=pp.make_mesh(data=4, stage=2),
        optimizer=optimizer("adamw", clip=True),
        zero=3,
    )
    step = pm.train_step(loss_fn)
    state = step.init(boxed, batches[0])
    losses = []
    for b in batches:
        state, loss = step(state, b)
        losses.append(float(loss))
    want_losses, want_params = optax_run("mlp", "adamw", True)
    np.testing.assert_allclose(losses, want_losses, rtol=TOL)
    assert rel_err(nn.meta.unbox(state.params), want_params) <= TOL


@pytest.mark.slow
def test_zero3_with_tied_weights_trains_like_optax():
    check("tied-gpt2", "zb-h1", (4, 2, 1), zero=3, opt_name="sgd")


def pipelines(zero: int):
    module, boxed, loss_fn, batches = problem("mlp")
    pm = pp.pipeline(
        module,
        stages=2,
        microbatches=BATCH // 8,
        mesh=pp.make_mesh(data=4, stage=2),
        optimizer=optimizer("adamw", clip=False),
        zero=zero,
    )
    return pm, boxed, loss_fn, batches


def test_zero3_holds_slices_and_its_module_view_joins_them():
    states = {}
    for zero in (0, 3):
        pm, boxed, loss_fn, batches = pipelines(zero)
        step = pm.train_step(loss_fn)
        states[zero] = (pm, step, step.init(boxed, batches[0]))
    pm, step, state = states[3]
    held = state.device_bytes()
    whole = states[0][2].device_bytes()
    # 2/D of the stage's parameters and optax state (its slices and the next
    # replica's copy), and what the memory report predicts
    assert max(held.values()) <= 1.1 * 2 / 4 * max(whole.values())
    shapes = jax.eval_shape(lambda: boxed)
    report = pm.memory_report(shapes, problem("mlp")[3][0], problem("mlp")[2])
    assert report.zero == 3
    assert all(d.state == max(held.values()) for d in report.devices)
    # the module view joins the slices: the same trees as zero=0's
    for got, want in (
        (state.params, states[0][2].params),
        (state.opt_state, states[0][2].opt_state),
    ):
        assert rel_err(nn.meta.unbox(got), nn.meta.unbox(want)) == 0
    # a device's lost slices are read from the copy its neighbour keeps
    devices = pm.mesh.devices[..., 0]
    lost = {devices[1, 0], devices[2, 1]}
    params, opt = state.view.to_module(state, skip=lost)
    assert rel_err(params, nn.meta.unbox(state.params)) == 0
    assert rel_err(opt, state.opt_state) == 0
    # and a state rebuilt from the module view is the same buffers
    again = step.init(state.params, problem("mlp")[3][0], state.opt_state, state.step)
    for a, b in zip(
        jax.tree.leaves((again.device_params, again.device_opt)),
        jax.tree.leaves((state.device_params, state.device_opt)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_zero3_memory_report_matches_the_compiled_step():
    """The tiny GPT on 4x2 at zero=3: the report's state is what init holds, and its
    total within the tolerance test_memory_report.py states of XLA's peak."""
    config = GPTConfig.tiny(vocab=65)
    x = np.random.default_rng(0).integers(0, 65, size=(32, config.seq_len)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    pm = pp.pipeline(
        GPT(config),
        stages=2,
        microbatches=4,
        mesh=pp.make_mesh(data=4, stage=2),
        optimizer=optax.adam(1e-3),
        zero=3,
    )
    report = pm.memory_report(
        jax.eval_shape(pm.init, jax.random.key(0), x), batch, lm_loss, compiled=True
    )
    assert abs(report.largest().total / report.compiled["compiled_peak"] - 1) <= COMPILED_TOLERANCE
    state = pm.train_step(lm_loss).init(pm.init(jax.random.key(0), x), batch)
    assert report.largest().state == max(state.device_bytes().values())


def test_zero3_refusals_name_the_option():
    module, *_ = problem("mlp")
    with pytest.raises(pp.OptionError, match=r"zero=3 with schedule='async-1f1b'"):
        pp.pipeline(
            module,
            stages=2,
            microbatches=2,
            schedule="async-1f1b",
            mesh=pp.make_mesh(data=2, stage=2),
            optimizer=optax.sgd(0.1),
            zero=3,
        )


@pytest.mark.parametrize(
    ("model", "kind"),
    [("llama", "1f1b"), pytest.param("tied-llama", "zb-h1", marks=pytest.mark.slow)],
)
def test_zero3_with_weights_split_over_tensor_trains_like_optax(model, kind):
    """2x2x2: each slice cuts a dimension 'tensor' does not split (Megatron's
    column- and row-parallel kernels, a vocabulary-split tied embedding)."""
    check(model, kind, (2, 2, 2), zero=3, opt_name="adamw")


def test_zero3_with_weights_split_over_tensor_holds_2_over_d():
    """GPT with Megatron splits on 4x1x2: a device holds its tensor part's slices
    and their copies, at most 1.1 x 2/D of what it holds without ZeRO."""
    config = GPTConfig.tiny(vocab=64)
    x = np.random.default_rng(0).integers(0, 64, size=(16, config.seq_len)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))
    held = {}
    for zero in (0, 3):
        pm = pp.pipeline(
            GPT(config),
            stages=1,
            microbatches=2,
            mesh=pp.make_mesh(data=4, stage=1, tensor=2),
            optimizer=optax.adam(1e-3),
            zero=zero,
        )
        state = pm.train_step(lm_loss).init(pm.init(jax.random.key(0), x), batch)
        held[zero] = max(state.device_bytes().values())
        report = pm.memory_report(jax.eval_shape(pm.init, jax.random.key(0), x), batch, lm_loss)
        assert report.largest().state == held[zero]
    assert held[3] <= 1.1 * 2 / 4 * held[0], held


@pytest.mark.slow
def test_zero3_failure_and_rejoin_keep_the_fault_free_losses():
    """Worker (1, 0) fails at step 1 (its rows turn to NaN, so reading them would
    break the run) and rejoins at step 2: its parameter and optax slices come from
    the copies replica 0 keeps, and the losses and final params equal the run
    without failures."""
    _, boxed, loss_fn, batches = problem("mlp")
    batches = [*batches, *batches]
    runs = {}
    for name, fail, rejoin in (("clean", {}, {}), ("failing", {1: [(1, 0)]}, {3: [(1, 0)]})):
        pm, *_ = pipelines(3)
        losses, params, switches = train_losing_failed_rows(
            pm, loss_fn, boxed, batches, fail, rejoin
        )
        runs[name] = (losses, params)
        assert switches == ([(1, [(1, 0)]), (3, [])] if fail else []), switches
    np.testing.assert_allclose(runs["failing"][0], runs["clean"][0], rtol=1e-5)
    assert rel_err(runs["failing"][1], runs["clean"][1]) <= 1e-5


def cli_losses(capsys, argv: list[str]) -> list[float]:
    """The losses `pjit-pipe train ... --json` prints, one per committed step."""
    from pjit_pipe.cli import main

    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return [json.loads(line)["loss"] for line in lines if line.startswith("{")]


@pytest.mark.slow
def test_cli_train_zero3_losses_equal_zero1s_through_a_failure(capsys):
    argv = ["train", "--model", "mlp", "--mesh", "4x2", "--steps", "4", "--json"]
    argv += ["--fail", "1:1:0", "--rejoin", "3:1:0"]
    losses = {zero: cli_losses(capsys, [*argv, "--zero", zero]) for zero in ("1", "3")}
    assert len(losses["3"]) == 4
    np.testing.assert_allclose(losses["3"], losses["1"], rtol=1e-5)


@pytest.mark.parametrize(
    ("saved", "restored"), [(((4, 2), 3), ((2, 2), 1)), (((2, 2), 0), ((4, 2), 3))]
)
def test_a_checkpoint_moves_across_zero_levels_and_meshes(tmp_path, saved, restored):
    """Saved on one mesh at one ZeRO level, restored on another at another: the
    parameters and every optax leaf (filled with distinct values) come back."""
    module, boxed, loss_fn, batches = problem("mlp")
    opt = optimizer("adamw", clip=False)
    params = nn.meta.unbox(boxed)
    ramp = lambda a: a + np.linspace(0.1, 1.0, a.size, dtype=a.dtype).reshape(a.shape)  # noqa: E731
    opt_state = jax.tree.map(lambda a: ramp(a) if a.dtype.kind == "f" else a + 3, opt.init(params))
    states = []
    for (D, P), zero in (saved, restored):
        pm = pp.pipeline(
            module,
            stages=P,
            microbatches=BATCH // D // 2,
            mesh=pp.make_mesh(data=D, stage=P),
            optimizer=opt,
            zero=zero,
        )
        states.append((pm.train_step(loss_fn), pm))
    step, _ = states[0]
    state = step.init(boxed, batches[0], opt_state, step=5)
    ckpt = pp.Checkpoints(tmp_path / "ckpt", every=5)
    ckpt.save(state, {"seen": 5})
    ckpt.close()
    other, pm = states[1]
    reader = pp.Checkpoints(tmp_path / "ckpt")
    back, data = reader.restore(other, batches[0], jax.eval_shape(lambda: boxed))
    reader.close()
    assert data == {"seen": 5} and back.step == 5
    assert rel_err(nn.meta.unbox(back.params), params) == 0
    for got, want in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_zero3_bf16_llama_trains_as_zero1():
    """The bundled Llama (an `nn.scan` stack, Megatron annotations, bf16 compute) at
    zero=3 gives zero=1's losses exactly: the gathered rows are the same
    parameters, and the update runs on the same slices."""
    config = LlamaConfig.tiny(
        vocab=32, seq_len=8, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, dtype=jnp.bfloat16
    )
    module = Llama(config)
    tokens = jax.random.randint(jax.random.key(0), (16, 9), 0, config.vocab)
    batch = (tokens[:, :-1], tokens[:, 1:])
    boxed = module.init(jax.random.key(1), batch[0])
    losses, held = {}, {}
    for zero in (1, 3):
        pm = pp.pipeline(
            module,
            stages=2,
            microbatches=2,
            mesh=pp.make_mesh(data=4, stage=2),
            optimizer=optax.adamw(1e-2),
            zero=zero,
        )
        step = pm.train_step(llama_loss)
        state = step.init(boxed, batch)
        held[zero] = max(state.device_bytes().values())
        losses[zero] = []
        for _ in range(3):
            state, loss = step(state, batch)
            losses[zero].append(float(loss))
    assert losses[3] == losses[1]
    assert held[3] < held[1]
