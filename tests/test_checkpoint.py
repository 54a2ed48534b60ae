"""Orbax checkpoints of the module-layout state: resume on any mesh, atomic saves,
and clear errors that overwrite nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity

import pjit_pipe as pp
from pjit_pipe.cli import main
from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.runtime.checkpoint import CheckpointError, Checkpoints

MODEL = ResidualMLP(d_model=16, hidden=16, n_layers=4, d_out=4)


def data(n: int = 16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, np.sin(x[:, :4])


def pipeline(model, D: int, P: int, kind: str = "1f1b"):
    mesh = pp.make_mesh(data=D, stage=P)
    return pp.pipeline(
        model, stages=P, microbatches=2, schedule=kind, mesh=mesh, optimizer=optax.adam(1e-2)
    )


def files(directory: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_restore_reshards_onto_another_mesh_and_a_crashed_save_keeps_the_last(
    tmp_path, monkeypatch
):
    batch = data()
    pm = pipeline(MODEL, 1, 2)
    params = pm.init(jax.random.key(0), batch[0])
    opt_state = jax.tree.map(lambda a: a + 1, optax.adam(1e-2).init(params))  # not a fresh one
    state = pm.train_step(mse_loss).init(params, batch, opt_state, step=1)
    saved = state.module_state()
    checkpoints = Checkpoints(tmp_path, every=1)
    assert checkpoints.save(state, {"position": 7})
    checkpoints.wait()
    newer = state.replace(step=2)

    # A crash after the data is written but before the atomic rename.
    calls = []

    async def crash(self):
        calls.append(self)
        raise RuntimeError("simulated crash during the save")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoints.save(newer, {"position": 8})
        checkpoints.wait()
    assert calls
    monkeypatch.undo()

    # A fresh run over the directory sees step 1, and restores it on a 2x2 zb-h1 layout.
    again = Checkpoints(tmp_path, every=1)
    assert again.latest_step() == 1
    other = pipeline(MODEL, 2, 2, "zb-h1")
    restored, position = again.restore(
        other.train_step(mse_loss), batch, jax.eval_shape(lambda: params)
    )
    assert position == {"position": 7} and restored.step == 1
    assert_trees_equal(restored.params, saved["params"])
    assert_trees_equal(restored.opt_state, saved["opt_state"])
    # each stage's leaves were read onto that stage's devices of the new mesh
    cut = other.cut(params, batch[0])
    for s, keys in enumerate(cut.keys):
        for key in keys:
            for leaf in jax.tree.leaves(restored.params["params"][key]):
                assert leaf.sharding.device_set == set(other.mesh.devices[:, s, 0])
    again.close()


def test_a_checkpoint_of_another_model_names_the_leaf_and_overwrites_nothing(tmp_path):
    batch = data()
    pm = pipeline(MODEL, 1, 2)
    params = pm.init(jax.random.key(0), batch[0])
    step = pm.train_step(mse_loss)
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(step.init(params, batch), None, force=True)
    checkpoints.close()
    before = files(tmp_path)

    wider = ResidualMLP(d_model=32, hidden=16, n_layers=4, d_out=4)
    other = pipeline(wider, 1, 2)
    like = jax.eval_shape(lambda: other.init(jax.random.key(0), batch[0]))
    with pytest.raises(CheckpointError, match=r"leaf .*\((32|16), (16|32)\).*\((16|32), (32|16)\)"):
        Checkpoints(tmp_path).restore(other.train_step(mse_loss), batch, like)
    assert files(tmp_path) == before


def test_bad_checkpoint_directories_and_intervals_fail_in_one_line(tmp_path, capsys):
    argv = ["train", "--model", "mlp", "--mesh", "1x2", "--microbatches", "2", "--steps", "1"]
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    assert main([*argv, "--checkpoint-dir", str(a_file)]) == 1
    err = capsys.readouterr().err
    assert "is a file" in err and len(err.strip().splitlines()) == 1
    assert a_file.read_text() == "keep me"

    assert main([*argv, "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint-every" in err and "must be >= 1" in err
    with pytest.raises(CheckpointError, match="--checkpoint-every"):
        Checkpoints(tmp_path, every=0)

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            assert main([*argv, "--checkpoint-dir", str(locked)]) == 1
            err = capsys.readouterr().err
            assert "not writable" in err and len(err.strip().splitlines()) == 1
            assert not any(locked.iterdir())
        finally:
            locked.chmod(0o700)


@pytest.mark.slow
def test_cli_resume_on_another_mesh_and_schedule_continues_the_run(tmp_path, capsys):
    """10 steps on 2x4 1f1b saving at step 6, then a resume of that checkpoint on
    4x2 zb-h1 for steps 6..9: the same losses as the uninterrupted run."""
    common = ["train", "--model", "mlp", "--microbatches", "2", "--batch", "16", "--json"]
    directory = tmp_path / "ckpt"
    first = [*common, "--mesh", "2x4", "--schedule", "1f1b", "--steps", "10"]
    assert main([*first, "--checkpoint-dir", str(directory), "--checkpoint-every", "6"]) == 0
    full = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in full] == list(range(10))
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["10", "6"]
    shutil.rmtree(directory / "10")  # as if the first run had stopped after step 6

    resumed_argv = [*common, "--mesh", "4x2", "--schedule", "zb-h1", "--steps", "10"]
    assert main([*resumed_argv, "--checkpoint-dir", str(directory)]) == 0
    resumed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in resumed] == [6, 7, 8, 9]
    np.testing.assert_allclose(
        [r["loss"] for r in resumed], [r["loss"] for r in full[6:]], rtol=1e-4
    )
    assert (directory / "10").is_dir()  # the resumed run saved its end
