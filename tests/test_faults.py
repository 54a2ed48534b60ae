"""Faults and bad inputs: a consumed state, non-finite steps, damaged checkpoints,
and the mistakes that must each give one line of a PjitPipeError subclass.

The compiled pipelines are shared by module-scoped fixtures: a 2x4 mesh (every
one of the 8 devices) for the steps, a 1x2 mesh for the checkpoints.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.cli import main
from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.runtime import InjectedFailures, ResilientTrainer

MODEL = ResidualMLP(d_model=8, hidden=8, n_layers=4, d_out=4)
ROOT = Path(__file__).resolve().parents[1]


def batch(seed: int, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, np.sin(x[:, :4])


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


def assert_close(a, b, rtol: float = 1e-6) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-7)


@pytest.fixture(scope="module")
def pm():
    """The 2x4 pipeline of the step tests (with adam)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the cut's imbalance note
        return pp.pipeline(
            MODEL,
            stages=4,
            microbatches=2,
            mesh=pp.make_mesh(data=2, stage=4),
            optimizer=optax.adam(1e-2),
        )


@pytest.fixture(scope="module")
def params(pm):
    return pm.init(jax.random.key(0), batch(0)[0])


@pytest.fixture(scope="module")
def step(pm):
    """The donating train step, compiled once for the module."""
    return pm.train_step(mse_loss)


@pytest.fixture(scope="module")
def clean_run(step, params):
    """Two clean steps (batches 1 and 2): the run that never saw a bad batch."""
    state = step.init(params, batch(1))
    for seed in (1, 2):
        state, _ = step(state, batch(seed))
    return state.params


# ---- a consumed state ----


def test_a_state_consumed_by_a_step_raises_state_error_not_a_crash(step, params):
    state = step.init(params, batch(1))
    old = state
    state, _ = step(state, batch(1))
    with pytest.raises(pp.StateError, match="consumed by an earlier step") as e:
        step(old, batch(1))
    assert "use the state that step returned" in one_line(e) and "donate=False" in one_line(e)
    with pytest.raises(pp.StateError, match="consumed"):
        old.params  # noqa: B018  (reading it would crash too)
    state, loss = step(state, batch(2))  # the process and the returned state live on
    assert np.isfinite(float(loss))


# ---- non-finite steps ----


def nan_in_x(x, y):
    x = x.copy()
    x[3, 5] = np.nan
    return x, y


def nan_in_y(x, y):
    y = y.copy()
    y[6, 1] = np.nan
    return x, y


def overflow(x, y):
    return x * np.float32(3e37), y  # finite inputs whose activations overflow to inf


@pytest.mark.parametrize("bad", [nan_in_x, nan_in_y, overflow])
def test_a_non_finite_step_is_skipped_and_reported(step, params, clean_run, bad):
    state = step.init(params, batch(1))
    state, _ = step(state, batch(1))
    with pytest.warns(RuntimeWarning, match="step 1: .*not finite; the update was skipped"):
        state, loss = step(state, bad(*batch(7)))
        assert state.skipped == 1 and state.step == 2  # the read that warns
    assert not np.isfinite(float(loss)) or bad is overflow
    state, loss = step(state, batch(2))
    assert np.isfinite(float(loss)) and state.skipped == 1
    assert_close(state.params, clean_run)  # as if the bad batch never came


@pytest.mark.filterwarnings("ignore:pipeline. compiling again")
def test_a_total_weight_of_zero_or_below_is_a_skipped_step(pm, params):
    """(loss_sum, weight) losses: the weight is y's last column."""

    def weighted(out, y):
        w = y[:, -1]
        return jnp.sum(w * jnp.mean((out[:, :3] - y[:, :3]) ** 2, -1)), jnp.sum(w)

    x, y = batch(1)
    ones = np.concatenate([y[:, :3], np.ones((8, 1), np.float32)], 1)
    step = pm.train_step(weighted)
    state = step.init(params, (x, ones))
    expected = jnp.mean((pm.apply(params, x)[:, :3] - y[:, :3]) ** 2)
    for weight in (0.0, -1.0):
        bad = ones.copy()
        bad[:, -1] = weight
        with pytest.warns(RuntimeWarning, match="skipped"):
            state, loss = step(state, (x, bad))
            _ = state.skipped  # reads the step's flag: the warning
        assert np.isnan(float(loss))
    assert state.skipped == 2
    state, loss = step(state, (x, ones))
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


def test_the_skip_flag_is_read_once_the_next_step_is_dispatched(step, params):
    """The step does not wait for its flag: no warning until the count is read or
    the next step is under way; then one warning, however often it is read."""
    state = step.init(params, batch(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here would fail the test
        skipped_state, _ = step(state, nan_in_x(*batch(1)))
    with pytest.warns(RuntimeWarning, match="step 0: .*not finite") as caught:
        state, _ = step(skipped_state, batch(2))
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read already: no second warning
        assert state.skipped == 1 and skipped_state.skipped == 1


def test_skip_nonfinite_false_applies_the_update(pm, params):
    step = pm.with_options(skip_nonfinite=False).train_step(mse_loss)
    state = step.init(params, batch(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skip warning
        state, _ = step(state, nan_in_x(*batch(1)))
    assert state.skipped == 0
    assert np.isnan(np.asarray(jax.tree.leaves(state.params)[0])).all()


def test_the_in_loop_optimizer_refuses_skip_nonfinite_by_name():
    with pytest.raises(pp.OptionError, match="skip_nonfinite=True: schedule='async-1f1b'") as e:
        pp.pipeline(MODEL, stages=2, microbatches=2, schedule="async-1f1b", skip_nonfinite=True)
    assert "update is applied" in one_line(e)
    with pytest.raises(pp.OptionError, match="skip_nonfinite"):
        pp.pipeline(MODEL, stages=2, microbatches=2, skip_nonfinite="yes")


def test_the_resilient_trainer_records_a_skipped_step(pm, params):
    trainer = ResilientTrainer(pm, mse_loss)
    state = trainer.init(params, batch(1), precompile=False)
    with pytest.warns(RuntimeWarning, match="skipped"):
        state, _ = trainer.step(state, nan_in_y(*batch(1)))
    state, _ = trainer.step(state, batch(2))
    kinds = [(e.step, e.kind) for e in trainer.events]
    assert kinds == [(0, "skipped")] and state.skipped == 1
    assert "not finite" in trainer.events[0].describe()


# ---- bad inputs of the Python API (the table 6) ----


def test_a_loss_fn_of_the_wrong_arity_is_refused_before_tracing(pm):
    with pytest.raises(pp.LossFnError, match=r"loss_fn: <lambda>\(out\) cannot be called") as e:
        pm.train_step(lambda out: jnp.mean(out))
    assert "outputs and y" in one_line(e)
    with pytest.raises(pp.LossFnError, match="cannot be called as loss_fn"):
        pm.value_and_grad(lambda out, y, z: jnp.mean(out))
    with pytest.raises(pp.LossFnError, match="expected a function"):
        pm.train_step("mse")


@pytest.mark.filterwarnings("ignore:pipeline. compiling again")
@pytest.mark.parametrize("returned", [None, 1.5])
def test_a_loss_fn_returning_no_array_is_a_loss_fn_error(pm, params, returned):
    x, y = batch(1)
    with pytest.raises(pp.LossFnError, match="floating scalar array") as e:
        pm.value_and_grad(lambda out, y: returned)(params, x, y)
    assert type(returned).__name__ in one_line(e)


def test_bad_step_arguments_name_the_fix(pm, step, params):
    state = step.init(params, batch(1))
    x, y = batch(1)
    with pytest.raises(pp.BatchError, match=r"expected the pair \(x, y\), got shape \(8, 8\)"):
        step(state, x)
    with pytest.raises(pp.StateError, match="expected a TrainState, got dict") as e:
        step(params, (x, y))
    assert "step.init(params, (x, y))" in one_line(e)
    with pytest.raises(pp.BatchError, match=r"x: expected arrays .* got a list .*np.asarray\(x\)"):
        step(state, (x.tolist(), y))
    with pytest.raises(pp.OptionError, match="with_options: unknown option 'bogus'") as e:
        pm.with_options(bogus=1)
    assert "skip_nonfinite" in one_line(e)  # it lists the options


def test_a_state_of_another_optimizer_or_model_is_a_state_error(pm, step, params):
    sgd_state = (
        pm.with_options(optimizer=optax.sgd(0.1)).train_step(mse_loss).init(params, batch(1))
    )
    with pytest.raises(pp.StateError, match=r"another optimizer's .*step.init") as e:
        step(sgd_state, batch(1))
    one_line(e)
    wide = pp.pipeline(
        ResidualMLP(d_model=16, hidden=8, n_layers=4, d_out=4),
        stages=4,
        microbatches=2,
        mesh=pp.make_mesh(data=2, stage=4),
        optimizer=optax.adam(1e-2),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wide_params = wide.init(jax.random.key(0), batch(1)[0])
        wide_state = wide.train_step(mse_loss).init(wide_params, batch(1))
        with pytest.raises(pp.StateError, match="do not fit this model") as e:
            step(wide_state, batch(1))
    one_line(e)


# ---- failure plans (the table 7) ----


@pytest.mark.parametrize(
    "plan, match",
    [
        ({"fail": {1: [(2, 0)]}}, "fail: worker 2:0 at step 1 is outside the mesh 2x4"),
        ({"rejoin": {2: [(0, 1)]}}, "rejoin: worker 0:1 is not down before step 2"),
        ({"fail": {1: [(0, 1)], 3: [(0, 1)]}}, "fail: worker 0:1 is already down at step 3"),
        ({"fail": {1: [(0, 1), (1, 1)]}}, "every replica of stage 1 is down"),
    ],
)
def test_a_failure_plan_is_checked_when_the_trainer_is_built(pm, plan, match):
    with pytest.raises(pp.FailurePlanError, match=match) as e:
        ResilientTrainer(pm, mse_loss, InjectedFailures(**plan))
    one_line(e)


def test_the_cli_refuses_a_failure_of_a_worker_already_down(capsys):
    argv = ["train", "--model", "mlp", "--mesh", "2x2", "--steps", "5"]
    assert main([*argv, "--fail", "1:0:1,3:0:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fail: worker 0:1 is already down at step 3" in err


def test_a_cache_dir_naming_a_file_is_refused(pm, tmp_path, capsys):
    file = tmp_path / "cache"
    file.write_text("")
    with pytest.raises(pp.OptionError, match=r"cache_dir .*is a file, not a directory") as e:
        ResilientTrainer(pm, mse_loss, cache_dir=str(file))
    one_line(e)
    argv = ["train", "--model", "mlp", "--mesh", "1x2", "--steps", "1", "--cache-dir", str(file)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a directory" in err


# ---- checkpoints ----


@pytest.fixture(scope="module")
def ckpt():
    """A 1x2 pipeline, its non-donating step, and the states of steps 1-3."""
    pm = pp.pipeline(
        MODEL,
        stages=2,
        microbatches=2,
        mesh=pp.make_mesh(data=1, stage=2),
        optimizer=optax.adam(1e-2),
    )
    params = pm.init(jax.random.key(0), batch(0)[0])
    step = pm.train_step(mse_loss, donate=False)
    states = [step.init(params, batch(0))]
    for seed in (1, 2, 3):
        states.append(step(states[-1], batch(seed))[0])
    return pm, step, params, states


def saved_steps(directory: Path, ckpt, steps=(1, 2, 3)) -> pp.Checkpoints:
    _, _, _, states = ckpt
    checkpoints = pp.Checkpoints(directory, every=1, keep=None)
    for s in steps:
        checkpoints.save(states[s], {"seen": s})
    checkpoints.wait()
    return checkpoints


def truncate(step_dir: Path) -> None:
    for f in glob.glob(f"{step_dir}/state/**/d/*", recursive=True):
        with open(f, "r+b") as handle:
            handle.truncate(8)


def drop_metadata(step_dir: Path) -> None:
    os.remove(step_dir / "state" / "_METADATA")


def empty(step_dir: Path) -> None:
    shutil.rmtree(step_dir)
    step_dir.mkdir()


def test_checkpoint_error_is_a_pjit_pipe_error():
    assert issubclass(pp.CheckpointError, pp.PjitPipeError)


@pytest.mark.parametrize("damage", [truncate, drop_metadata, empty])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, ckpt, damage):
    _, step, params, states = ckpt
    saved_steps(tmp_path, ckpt).close()
    damage(tmp_path / "3")
    checkpoints = pp.Checkpoints(tmp_path, every=1)
    with pytest.warns(RuntimeWarning, match="checkpoint step 3: .*restoring the newest") as w:
        state, data = checkpoints.restore(step, batch(0), params)
    assert len([x for x in w if x.category is RuntimeWarning]) == 1
    assert state.step == 2 and data == {"seen": 2}
    assert_close(state.params, states[2].params, rtol=0)
    assert_close(state.opt_state, states[2].opt_state, rtol=0)
    assert (tmp_path / "3.unreadable").is_dir()  # set aside: step 3 can be saved again
    assert checkpoints.save(states[3], {"seen": 3}) and checkpoints.latest_step() == 3
    checkpoints.close()


def test_checkpoint_errors_are_one_line_and_name_the_fix(tmp_path, ckpt):
    pm, step, params, states = ckpt
    for keep in (0, -1, 1.5, True):
        with pytest.raises(pp.CheckpointError, match="keep: expected a positive number"):
            pp.Checkpoints(tmp_path / "k", keep=keep)
    checkpoints = saved_steps(tmp_path / "c", ckpt, steps=(1, 2))
    with pytest.raises(pp.CheckpointError, match="data must be JSON") as e:
        checkpoints.save(states[3], {"when": object()})
    one_line(e)
    checkpoints.wait()
    assert sorted(os.listdir(tmp_path / "c")) == ["1", "2"]  # no temporary directory
    with pytest.raises(pp.CheckpointError, match=r"step=99: no checkpoint .* steps \[1, 2\]"):
        checkpoints.restore(step, batch(0), params, step=99)
    sgd = pm.with_options(optimizer=optax.sgd(0.1)).train_step(mse_loss, donate=False)
    with pytest.raises(pp.CheckpointError, match="is of another optimizer") as e:
        checkpoints.restore(sgd, batch(0), params)
    assert "the optimizer it was saved with" in one_line(e)
    checkpoints.close()
    for s in (1, 2):
        empty(tmp_path / "c" / str(s))
    damaged = pp.Checkpoints(tmp_path / "c")
    with pytest.raises(pp.CheckpointError, match=r"no readable checkpoint .* step 2: ") as e:
        damaged.restore(step, batch(0), params)
    one_line(e)
    damaged.close()
    kept = pp.Checkpoints(tmp_path / "all", every=1, keep=None)
    for s in (1, 2, 3):
        kept.save(states[s])
    kept.close()
    assert sorted(os.listdir(tmp_path / "all")) == ["1", "2", "3"]


# ---- the CLI: resume, skipped steps ----

CLI = ["train", "--model", "mlp", "--mesh", "1x2", "--microbatches", "2", "--json"]


def run_cli(capsys, *args: str) -> tuple[int, list[dict], str]:
    code = main([*CLI, *args])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


@pytest.fixture(scope="module")
def cli_reference() -> list[dict]:
    """The records of a 6-step CLI run without checkpoints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*CLI, "--steps", "6"]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize(
    "damage",
    [
        truncate,
        pytest.param(drop_metadata, marks=pytest.mark.slow),
        pytest.param(empty, marks=pytest.mark.slow),
    ],
)
def test_the_cli_resumes_past_a_damaged_checkpoint_and_continues_the_curve(
    tmp_path, capsys, cli_reference, damage
):
    assert all(r["skipped"] == 0 for r in cli_reference)
    directory = str(tmp_path / "ck")
    every = ["--checkpoint-dir", directory, "--checkpoint-every", "2"]
    assert run_cli(capsys, "--steps", "4", *every)[0] == 0
    damage(tmp_path / "ck" / "4")
    code, resumed, err = run_cli(capsys, "--steps", "6", *every)
    assert code == 0 and [r["step"] for r in resumed] == [2, 3, 4, 5]
    assert err.count("warning: checkpoint step 4:") == 1 and err.count("\n") == 1
    assert [r["loss"] for r in resumed] == [r["loss"] for r in cli_reference[2:]]
    code, records, err = run_cli(capsys, "--steps", "5", *every)  # at step 6 now
    assert code == 0 and records == []
    assert "already at step 6, at or past --steps 5" in err


def test_the_cli_counts_skipped_steps(monkeypatch, capsys):
    from pjit_pipe.cli import train as train_cli

    make_task = train_cli.make_task

    def with_a_nan_batch(name, size, seed, tensor=1):
        task = make_task(name, size, seed, tensor)
        clean, calls = task.next_batch, []

        def next_batch():
            calls.append(1)
            x, y = clean()
            return nan_in_x(x, y) if len(calls) == 2 else (x, y)  # step 1's batch

        task.next_batch = next_batch
        return task

    monkeypatch.setattr(train_cli, "make_task", with_a_nan_batch)
    code, records, err = run_cli(capsys, "--steps", "3")
    assert code == 0 and [r["skipped"] for r in records] == [0, 1, 1]
    assert err.startswith("warning: step 1: the loss (nan)") and err.count("\n") == 1
    assert any("skipped" in line for line in records[1]["events"])


@pytest.mark.slow
def test_a_resume_restores_the_failed_workers(tmp_path, capsys):
    argv = ["--mesh", "2x2", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    code, first, _ = run_cli(capsys, "--steps", "4", "--fail", "1:0:1", *argv)
    assert code == 0 and first[-1]["failed"] == ["0:1"]
    code, resumed, _ = run_cli(capsys, "--steps", "6", "--rejoin", "5:0:1", *argv)
    assert code == 0 and [r["failed"] for r in resumed] == [["0:1"], []]


def _finished(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a CLI child to its end; a failure shows the child's stderr."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_sigkill_during_checkpointed_training_resumes_with_identical_losses(tmp_path):
    """A run killed (SIGKILL) while it saves every step resumes from the newest
    complete checkpoint and its losses are those of a run never killed."""
    argv = [sys.executable, "-m", "pjit_pipe", *CLI, "--steps", "12"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    reference = _finished(argv, env)
    losses = {r["step"]: r["loss"] for r in map(json.loads, reference.stdout.splitlines())}
    ck = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    with subprocess.Popen([*argv, *ck], env=env, stdout=subprocess.PIPE, text=True) as run:
        seen = [json.loads(run.stdout.readline()) for _ in range(5)]
        time.sleep(0.05)  # into the next step's save
        run.send_signal(signal.SIGKILL)
    assert run.returncode == -signal.SIGKILL
    again = _finished([*argv, *ck], env)
    resumed = [json.loads(line) for line in again.stdout.splitlines()]
    assert resumed and resumed[0]["step"] >= seen[-1]["step"] - 1 and resumed[-1]["step"] == 11
    assert all(r["loss"] == losses[r["step"]] for r in resumed)
