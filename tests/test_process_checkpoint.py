"""Checkpoints of a multi-process job (runtime/process_checkpoint.py): each process
saves its own stages with no collective, and a step is saved when the complete
copies hold every leaf. In one process: a copy round-trips a scan stack split
over stages onto another cut, ZeRO-1 and ZeRO-3 slices join into the module
leaves onto another cut and level, and a step some leaf or slice of which is
in no complete copy is not saved. Over real processes (`pjit-pipe train
--processes 4` on a 2x2 mesh, one stage per process): save and resume without
failure, saves after a process was killed, and a process killed inside its own
save, with ZeRO-1 too; each resumed run gives plain optax's losses
(tests/test_process_failure.py).
"""

from __future__ import annotations

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from benchmarks.bench_process_failure import run_with_kill
from pjit_pipe.runtime import ProcessCheckpoints
from pjit_pipe.runtime.process_checkpoint import KILL_IN_SAVE
from tests.test_process_failure import MICROBATCHES, TIMEOUT_S, optax_losses


class Stack(nn.Module):
    """A dense layer, then an nn.scan stack of 4 stacked layers (cut between its
    rows), then a head."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="inp")(x)
        block = lambda: nn.scan(  # noqa: E731
            Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
        )
        h, _ = block()(name="stack")(h, None)
        return nn.Dense(2, name="out")(h)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(h.shape[-1])(h)), None


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def stack_state(stages: int, data: int = 1, zero: int = 0):
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    pm = pp.pipeline(
        Stack(),
        stages=stages,
        microbatches=2,
        mesh=pp.make_mesh(data=data, stage=stages),
        optimizer=optax.adam(1e-2),
        zero=zero,
    )
    params = jax.jit(Stack().init)(jax.random.key(0), x)
    return pm, params, (x, y)


@pytest.mark.slow
def test_a_copy_restores_onto_another_cut_and_needs_every_leaf(tmp_path):
    pm, params, batch = stack_state(4)
    opt_state = jax.tree.map(lambda a: a + 1, optax.adam(1e-2).init(params))  # not fresh
    state = pm.train_step(mse).init(params, batch, opt_state, step=4)
    checkpoints = ProcessCheckpoints(tmp_path, every=2)
    assert checkpoints.save(state, {"position": 3})
    checkpoints.close()
    assert checkpoints.latest_step() == 4
    (copy,) = tmp_path.glob("step_*")
    index = json.loads((copy / "index.json").read_text())
    rows = {tuple(p["rows"]) for p in index["pieces"] if "stack" in p["name"] and p["rows"]}
    assert len(rows) > 1  # the stack's rows were saved by stage, as the cut split them

    other, _, _ = stack_state(2, data=2)
    like = jax.eval_shape(lambda: params)
    restored, data = ProcessCheckpoints(tmp_path).restore(other.train_step(mse), batch, like)
    assert data == {"position": 3} and restored.step == 4
    for got, want in ((restored.params, params), (restored.opt_state, opt_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))

    # A leaf's rows missing from every complete copy: the step is not saved, and a
    # partial copy (a process killed before its rename) is never read.
    index["pieces"] = [p for p in index["pieces"] if p["rows"] != [1, 2]]
    (copy / "index.json").write_text(json.dumps(index))
    assert ProcessCheckpoints(tmp_path).latest_step() is None
    copy.rename(tmp_path / f".{copy.name}.partial")
    assert ProcessCheckpoints(tmp_path).saved_steps() == []

    # keep=2: a process deletes its own copies of the steps older than the 2 newest.
    checkpoints = ProcessCheckpoints(tmp_path, every=1, keep=2)
    for step in (5, 6, 7):
        assert checkpoints.save(state.replace(step=step))
    checkpoints.close()
    assert checkpoints.saved_steps() == [6, 7]


def assert_restores(directory, params, opt_state, stages: int, data: int, zero: int) -> None:
    """The newest step in `directory` restores to exactly `params` and `opt_state`
    on a `data` x `stages` mesh at ZeRO level `zero`."""
    other, _, batch = stack_state(stages, data=data, zero=zero)
    like = jax.eval_shape(lambda: params)
    restored, _ = ProcessCheckpoints(directory).restore(other.train_step(mse), batch, like)
    for got, want in ((restored.params, params), (restored.opt_state, opt_state)):
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.slow
@pytest.mark.parametrize("zero, target", [(1, 3), (3, 0)], ids=["zero1", "zero3"])
def test_zero_slices_restore_onto_another_cut_and_level_and_need_every_slice(
    tmp_path, zero, target
):
    """A ZeRO state on 2x4 (each device keeps its replica's slices of the optax
    state, with zero=3 of the parameters too, and a copy of the next replica's)
    saves slices; they join into the module leaves on 4x2 at another level."""
    pm, params, batch = stack_state(4, data=2, zero=zero)
    opt_state = jax.tree.map(lambda a: a + 1, optax.adam(1e-2).init(params))  # not fresh
    state = pm.train_step(mse).init(params, batch, opt_state, step=4)
    checkpoints = ProcessCheckpoints(tmp_path, every=2)
    assert checkpoints.save(state)
    checkpoints.close()
    (copy,) = tmp_path.glob("step_*")
    index = json.loads((copy / "index.json").read_text())
    sliced = [p for p in index["pieces"] if "group" in p]
    assert {p["slice"] for p in sliced} == {0, 1}  # both replicas' slices
    named = {p["name"] for p in index["pieces"] if "name" in p}
    assert any("params/" in n for n in named) == (zero == 1)  # zero=3: parameters in slices
    assert_restores(tmp_path, state.params, state.opt_state, 2, 4, target)
    assert_restores(tmp_path, params, opt_state, 2, 4, target)

    # One slice missing from every complete copy: the step is not saved.
    index["pieces"].remove(sliced[-1])
    (copy / "index.json").write_text(json.dumps(index))
    assert ProcessCheckpoints(tmp_path).latest_step() is None


def train_args(steps: int, directory, zero: int = 0) -> list[str]:
    args = ["--model", "mlp", "--mesh", "2x2", "--schedule", "1f1b", "--zero", str(zero)]
    args += ["--microbatches", str(MICROBATCHES), "--steps", str(steps), "--processes", "4"]
    return [*args, "--checkpoint-dir", str(directory), "--checkpoint-every", "4"]


def copies(directory) -> dict[int, list[int]]:
    """Saved step -> the processes whose complete copy of it is there."""
    out: dict[int, list[int]] = {}
    for path in sorted(directory.glob("step_*/index.json")):
        step, process = path.parent.name.removeprefix("step_").split(".process_")
        out.setdefault(int(step), []).append(int(process))
    return out


def resume(tmp_path, directory, steps: int, first: int, zero: int = 0) -> None:
    """A new 4-process run over `directory` resumes at step `first` and trains to
    `steps` with plain optax's losses."""
    folder = tmp_path / f"resume{first}"
    folder.mkdir()
    args = train_args(steps, directory, zero)
    run = run_with_kill(folder, args, None, 0, TIMEOUT_S, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.records] == list(range(first, steps))
    want = optax_losses(steps)[first:]
    np.testing.assert_allclose([r["loss"] for r in run.records], want, rtol=1e-5)


@pytest.mark.processes
@pytest.mark.slow
def test_processes_save_and_resume_without_failure(tmp_path):
    directory = tmp_path / "ckpt"
    run = run_with_kill(tmp_path, train_args(6, directory), None, 0, TIMEOUT_S, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    np.testing.assert_allclose([r["loss"] for r in run.records], optax_losses(6), rtol=1e-5)
    assert copies(directory) == {4: [1, 2, 3, 4], 6: [1, 2, 3, 4]}
    resume(tmp_path, directory, 10, 6)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("in_save", [False, True], ids=["killed", "killed-in-save"])
def test_processes_save_after_a_kill_and_resume(tmp_path, monkeypatch, in_save):
    """Process 2 (worker (0, 1)) SIGKILLed after step 4 is committed, or by itself
    inside its save of step 4 with its arrays written and its index not: the
    survivors go on re-routed and save steps 4 (a peer holds stage 1 too), 8 and
    12 without it; a new run resumes from step 12."""
    directory = tmp_path / "ckpt"
    victim = None
    if in_save:
        monkeypatch.setenv(KILL_IN_SAVE, "2:4")
    else:
        victim = 2
    run = run_with_kill(tmp_path, train_args(12, directory), victim, 4, TIMEOUT_S, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.records] == list(range(12))
    np.testing.assert_allclose([r["loss"] for r in run.records], optax_losses(12), rtol=1e-5)
    assert any(e["event"] == "switch" for e in run.events)  # the run was re-routed
    saved = copies(directory)
    assert saved[8] == saved[12] == [1, 3, 4]
    assert saved[4] == ([1, 3, 4] if in_save else [1, 2, 3, 4])
    if in_save:  # the killed save left only a partial directory, which nothing reads
        assert (directory / ".step_00000004.process_2.partial" / "arrays.bin").exists()
    assert ProcessCheckpoints(directory).saved_steps() == [4, 8, 12]
    monkeypatch.delenv(KILL_IN_SAVE, raising=False)
    resume(tmp_path, directory, 16, 12)


@pytest.mark.processes
@pytest.mark.slow
def test_processes_save_zero_slices_after_a_kill_in_save_and_resume(tmp_path, monkeypatch):
    """--zero 1: process 2 (worker (0, 1)) SIGKILLs itself inside its save of step 4.
    Step 4 is saved all the same: its peer's copy holds stage 1's optax slices,
    its own and the neighbour copy of the dead replica's. The survivors go on
    re-routed (the failure variant runs without ZeRO, so steps 8 and 12 are saved
    as whole leaves). With the later steps' copies deleted, a new ZeRO-1 run joins
    step 4's slices and resumes there with plain optax's losses."""
    directory = tmp_path / "ckpt"
    monkeypatch.setenv(KILL_IN_SAVE, "2:4")
    run = run_with_kill(tmp_path, train_args(12, directory, zero=1), None, 0, TIMEOUT_S, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.records] == list(range(12))
    np.testing.assert_allclose([r["loss"] for r in run.records], optax_losses(12), rtol=1e-5)
    assert any(e["event"] == "switch" for e in run.events)
    saved = copies(directory)
    assert saved[4] == saved[8] == saved[12] == [1, 3, 4]
    index = json.loads((directory / "step_00000004.process_4" / "index.json").read_text())
    assert {p["slice"] for p in index["pieces"] if "group" in p} == {0, 1}
    assert ProcessCheckpoints(directory).saved_steps() == [4, 8, 12]
    monkeypatch.delenv(KILL_IN_SAVE)
    for path in [*directory.glob("step_00000008.*"), *directory.glob("step_00000012.*")]:
        shutil.rmtree(path)
    resume(tmp_path, directory, 8, 4, zero=1)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_tensor_parts_join_into_leaves_that_restore_on_another_mesh(tmp_path, zero):
    """A Llama whose weights split over 'tensor' (2x2x2, with ZeRO-3 in slices
    over data too): each worker's split buffers are joined from its two devices,
    and the copy restores to the same leaves on 4x2 without a tensor axis."""
    from pjit_pipe.models import lm_loss
    from pjit_pipe.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64))
    x = np.random.default_rng(0).integers(0, 64, size=(8, 32)).astype(np.int32)
    batch = (x, np.roll(x, -1, axis=1))

    def pipelined(data: int, tensor: int, level: int):
        mesh = pp.make_mesh(data=data, stage=2, tensor=tensor)
        opt = optax.adam(1e-2)
        return pp.pipeline(model, stages=2, microbatches=2, mesh=mesh, optimizer=opt, zero=level)

    pm = pipelined(2, 2, zero)
    params = pm.init(jax.random.key(0), x)
    step = pm.train_step(lm_loss)
    state, _ = step(step.init(params, batch), batch)  # trained: moments not fresh
    checkpoints = ProcessCheckpoints(tmp_path, every=1)
    assert checkpoints.save(state)
    checkpoints.close()
    like = jax.eval_shape(lambda: nn.meta.unbox(params))
    other = pipelined(4, 1, 0).train_step(lm_loss)
    restored, _ = ProcessCheckpoints(tmp_path).restore(other, batch, like)
    assert restored.step == 1
    for got, want in ((restored.params, state.params), (restored.opt_state, state.opt_state)):
        got, want = nn.meta.unbox(got), nn.meta.unbox(want)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
