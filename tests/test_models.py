"""The example models, unpipelined and pipelined, and `pjit-pipe train`."""

import json

import jax
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.cli import main
from pjit_pipe.models import GPT, GPTConfig, ResidualMLP, lm_loss, mse_loss
from pjit_pipe.models.char_corpus import CharCorpus
from tests.numerics import rel_err


def gpt_batch(n: int):
    corpus = CharCorpus.load()
    x, y = corpus.batch(np.random.default_rng(0), n, 32)
    return GPT(GPTConfig.tiny(vocab=corpus.vocab)), x, y


def mlp_batch(n: int):
    rng = np.random.default_rng(0)
    return (
        ResidualMLP(),
        rng.normal(size=(n, 16)).astype(np.float32),
        rng.normal(size=(n, 8)).astype(np.float32),
    )


def test_gpt_is_causal_and_plain_flax():
    model, x, _ = gpt_batch(2)
    params = model.init(jax.random.key(0), x)
    logits = model.apply(params, x)
    assert logits.shape == (2, 32, model.config.vocab)
    changed = x.copy()
    changed[:, 20:] = (changed[:, 20:] + 1) % model.config.vocab
    np.testing.assert_allclose(model.apply(params, changed)[:, :20], logits[:, :20], atol=1e-6)
    assert not np.allclose(model.apply(params, changed)[:, 20:], logits[:, 20:])


def test_corpus_round_trip():
    corpus = CharCorpus.load()
    assert len(corpus.text) > 2000
    assert corpus.decode(corpus.encode(corpus.text[:300])) == corpus.text[:300]
    with pytest.raises(ValueError, match="not in the corpus vocabulary"):
        corpus.encode("\x00")


@pytest.mark.parametrize(
    "make,loss_fn,mesh,options",
    [
        (gpt_batch, lm_loss, (2, 4), dict(schedule="zb-h1", microbatches=4)),
        (mlp_batch, mse_loss, (2, 2), dict(schedule="interleaved-1f1b", microbatches=4, chunks=2)),
        # Priced with the Zero Bubble paper's costs (C > 0), the table defers its
        # gradients to the start of the next tick (tick_packing/send_timing.py).
        (
            gpt_batch,
            lm_loss,
            (1, 4),
            dict(schedule="zb-h1", microbatches=4, costs=pp.Costs(5, 6, 4, 1)),
        ),
    ],
    ids=["gpt-2x4-zb-h1", "mlp-2x2-interleaved", "gpt-1x4-zb-h1-deferred"],
)
def test_pipelined_value_and_grad_matches_jax(make, loss_fn, mesh, options):
    model, x, y = make(16)
    pm = pp.pipeline(model, stages=mesh[1], mesh=pp.make_mesh(*mesh), **options)
    assert pm.tick_table().deferred == ("costs" in options)
    params = pm.init(jax.random.key(0), x)
    loss, grads = pm.value_and_grad(loss_fn)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(model.apply(p, x), y)))(
        params
    )
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def test_five_adam_steps_match_unpipelined_training():
    model, x, y = mlp_batch(8)
    optimizer = optax.adam(1e-2)
    pm = pp.pipeline(
        model,
        stages=4,
        microbatches=4,
        schedule="1f1b",
        mesh=pp.make_mesh(1, 4),
        optimizer=optimizer,
    )
    params = pm.init(jax.random.key(0), x)
    step = pm.train_step(mse_loss)
    state = step.init(params, (x, y))

    @jax.jit
    def reference(p, opt):
        loss, g = jax.value_and_grad(lambda p: mse_loss(model.apply(p, x), y))(p)
        updates, opt = optimizer.update(g, opt, p)
        return optax.apply_updates(p, updates), opt, loss

    ref_params, ref_opt = params, optimizer.init(params)
    for _ in range(5):
        state, loss = step(state, (x, y))
        ref_params, ref_opt, ref_loss = reference(ref_params, ref_opt)
        assert rel_err(loss, ref_loss) < 1e-5
    assert state.step == 5
    assert jax.tree.structure(state.params) == jax.tree.structure(params)
    assert rel_err(state.params, ref_params) < 1e-5
    # The optimizer state is in the module's layout too: optax's own state of the params.
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(ref_opt)
    assert rel_err(state.opt_state, ref_opt) < 1e-5


def test_train_cli_prints_json_per_step(capsys):
    argv = ["train", "--model", "mlp", "--mesh", "1x2", "--microbatches", "2", "--steps", "3"]
    assert main([*argv, "--json", "--lr", "0.01"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in records)


def test_train_cli_rejects_bad_mesh(capsys):
    assert main(["train", "--mesh", "2by4"]) == 2
    assert "expected DxP" in capsys.readouterr().err


def test_train_cli_through_a_failure_matches_a_run_without(capsys):
    argv = ["train", "--model", "mlp", "--mesh", "2x2", "--microbatches", "2", "--steps", "5"]
    assert main([*argv, "--json"]) == 0
    clean = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--json", "--fail", "1:1:0", "--rejoin", "3:1:0", "--precompile", "0"]) == 0
    faulty = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["failed"] for r in faulty] == [[], ["1:0"], ["1:0"], [], []]
    assert any("failed" in e for e in faulty[1]["events"])
    # --precompile 0: the variant compiles when the step needs it, and the step says it waits
    assert any("not compiled yet; waiting" in e for e in faulty[1]["events"])
    np.testing.assert_allclose([r["loss"] for r in faulty], [r["loss"] for r in clean], rtol=1e-5)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--fail", "3:2:0"], "outside the mesh"),
        (["--rejoin", "1:0:5"], "outside the mesh"),
        (["--fail", "x:1:0"], "STEP:R:S"),
        (["--precompile", "-1"], "must be >= 0"),
    ],
)
def test_train_cli_rejects_bad_failures(capsys, extra, message):
    assert main(["train", "--model", "mlp", "--mesh", "2x2", *extra]) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
