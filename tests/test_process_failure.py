"""A real process death: `pjit-pipe train --processes 4` on a 2x2 mesh (one device per
process, gloo), one training process killed with SIGKILL mid-run by its pid from the
events file. Training must go on, commit every step once and give the losses of
plain optax on the same batches, computed here with jax.value_and_grad.
"""

import jax
import numpy as np
import optax
import pytest

from benchmarks.bench_process_failure import run_with_kill
from pjit_pipe.cli import main
from pjit_pipe.cli.train import make_task
from pjit_pipe.cli.train_processes import process_workers
from pjit_pipe.errors import OptionError
from pjit_pipe.ir.ops import Worker
from pjit_pipe.runtime import LiveDevices, recovery_settings

TIMEOUT_S = 420  # the CLI's whole run, compiles included (2 cores, 5 processes)
STEPS, MESH, MICROBATCHES, LR = 24, (2, 2), 2, 3e-3
COMBO_STEPS = 10  # the combinations' runs: the kill comes after step 2
CLIP = "1.0"  # binds: the first gradients' global norms are 3.7 (mlp) and 5.3 (gpt-tiny)


def optax_losses(
    steps: int, model: str = "mlp", tensor: int = 1, clip: float | None = None
) -> list[float]:
    """The CLI's run of `model` as plain optax: the same seed, batches and Adam (after
    a global-norm clip to `clip`, if given)."""
    data, _ = MESH
    task = make_task(model, 2 * data * MICROBATCHES, seed=0, tensor=tensor)
    x, y = task.next_batch()
    params = task.model.init(jax.random.key(0), x)
    opt = optax.adam(LR)
    if clip is not None:
        opt = optax.chain(optax.clip_by_global_norm(clip), opt)
    state = opt.init(params)
    grad = jax.jit(jax.value_and_grad(lambda p, x, y: task.loss_fn(task.model.apply(p, x), y)))
    losses = []
    for _ in range(steps):
        loss, g = grad(params, x, y)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
        x, y = task.next_batch()
    return losses


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize(
    "victim, stop_s",
    [
        # Process 1 is the first training process (process 0 only hosts the
        # coordination service) and holds the mesh's first device: killed.
        (1, None),
        # Process 2 stopped (SIGSTOP) for twice the collective timeout, then resumed
        # (SIGCONT): a dead process to the service, so its worker is re-routed; the
        # resumed process must not break the job.
        (2, 12.0),
    ],
    ids=["killed", "stopped"],
)
def test_training_goes_on_after_a_process_is_killed_or_stopped(tmp_path, victim, stop_s):
    args = ["--model", "mlp", "--mesh", "x".join(map(str, MESH)), "--schedule", "1f1b"]
    args += ["--microbatches", str(MICROBATCHES), "--steps", str(STEPS), "--processes", "4"]
    run = run_with_kill(tmp_path, args, victim, 3, TIMEOUT_S, tmp_path / "cache", stop_s)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.killed_at is not None
    steps = [r["step"] for r in run.records]
    assert steps == list(range(STEPS)), steps  # each step once, in order, none skipped
    np.testing.assert_allclose([r["loss"] for r in run.records], optax_losses(STEPS), rtol=1e-5)
    victim_workers = sorted(map(tuple, run.workers[victim]))
    assert victim_workers == [(0, victim - 1)]
    failure = run.first_after_kill("failure")
    switch = run.first_after_kill("switch")
    assert failure is not None and switch is not None, run.events
    assert sorted(map(tuple, failure["failed"])) == victim_workers
    assert sorted(map(tuple, switch["failed"])) == victim_workers
    after = [r for r in run.records if r["step"] >= failure["step"]]
    assert all(r["failed"] == [f"0:{victim - 1}"] for r in after)  # the re-routed program ran them
    first = run.first_after_kill("step")
    assert first["t"] - run.killed_at < 30  # detection plus the retried step
    logged = [e["step"] for e in run.events if e["event"] == "step"]
    assert logged == list(range(STEPS))


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, tensor, options, victim",
    [
        # ZeRO-1: the dead replica's optax slices live on as its neighbour's copy.
        ("mlp", 1, ["--zero", "1", "--schedule", "1f1b"], 2),
        # ZeRO-3 (parameters in slices too) under a 2-chunk kind, a replica-1 death,
        # each microbatch's gradient reduce-scattered into the slices as it is made.
        ("mlp", 1, ["--zero", "3", "--grad-sum", "slices", "--schedule", "interleaved-1f1b"], 3),
        # Tensor parallelism: each process holds one worker's two 'tensor' devices,
        # their parameter and optax slices (ZeRO-3) and a global-norm clip; with
        # --restart the killed process rejoins from the survivors' process copies,
        # each worker's tensor parts joined.
        ("gpt-tiny", 2, ["--schedule", "1f1b", "--clip", CLIP, "--zero", "3", "--restart"], 2),
    ],
    ids=["zero1", "zero3-interleaved", "tensor2"],
)
def test_every_combination_survives_a_killed_process(tmp_path, model, tensor, options, victim):
    args = ["--model", model, "--mesh", f"2x2x{tensor}", *options]
    args += ["--microbatches", str(MICROBATCHES), "--steps", str(COMBO_STEPS)]
    args += ["--processes", "4"]
    run = run_with_kill(tmp_path, args, victim, 2, TIMEOUT_S, tmp_path / "cache")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.records] == list(range(COMBO_STEPS))
    clip = float(CLIP) if "--clip" in options else None
    expected = optax_losses(COMBO_STEPS, model, tensor, clip)
    np.testing.assert_allclose([r["loss"] for r in run.records], expected, rtol=1e-5)
    failure = run.first_after_kill("failure")
    assert failure is not None, run.events
    assert sorted(map(tuple, failure["failed"])) == sorted(map(tuple, run.workers[victim]))
    rejoins = [e for e in run.events if e["event"] == "rejoin"]
    assert len(rejoins) == ("--restart" in options)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("victim, then", [(2, 3), (0, None)], ids=["rejoin", "coordinator"])
def test_restart_makes_the_mesh_whole_again(tmp_path, victim, then):
    # --restart: a killed training process (2) rejoins at the step the survivors
    # stopped and saved at. Then process 3 is killed as soon as the restarted job
    # has committed a step, while that job still compiles the programs for the
    # other processes' deaths in the background: the survivors wait for its
    # compile, meet, run it, and 3 rejoins too. The coordinator's death (process 0,
    # which every process needs) restarts the whole job from the newest checkpoint
    # (saved every 4 steps).
    steps = 16
    args = ["--model", "mlp", "--mesh", "2x2", "--schedule", "1f1b", "--microbatches", "2"]
    args += ["--steps", str(steps), "--processes", "4", "--restart", "--checkpoint-every", "4"]
    run = run_with_kill(tmp_path, args, victim, 3, 2 * TIMEOUT_S, tmp_path / "cache", then=then)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [r["step"] for r in run.records] == list(range(steps))  # each printed once
    np.testing.assert_allclose([r["loss"] for r in run.records], optax_losses(steps), rtol=1e-5)
    starts = [e for e in run.events if e["event"] == "process" and e["process"] == victim]
    assert any(e["t"] > run.killed_at for e in starts)  # the victim started again
    rejoins = [e for e in run.events if e["event"] == "rejoin"]
    if victim == 0:  # a restart from a checkpoint, not a rejoin at a planned stop
        assert rejoins == []
        return
    assert [sorted(map(tuple, e["workers"])) for e in rejoins] == [[(0, 1)], [(1, 0)]]
    assert run.then_killed_at is not None
    starts = [e for e in run.events if e["event"] == "process" and e["process"] == then]
    assert any(e["t"] > run.then_killed_at for e in starts)  # and so did `then`
    failures = [e for e in run.events if e["event"] == "failure"]
    first = min(failures, key=lambda e: e["t"])
    second = min((e for e in failures if e["t"] > run.then_killed_at), key=lambda e: e["t"])
    assert first["step"] < rejoins[0]["step"] <= second["step"] < rejoins[1]["step"]
    # Re-routed until each stop, the whole mesh from each rejoin on.
    for failure, rejoin, down in ((first, rejoins[0], ["0:1"]), (second, rejoins[1], ["1:0"])):
        assert all(
            r["failed"] == down
            for r in run.records
            if failure["step"] <= r["step"] < rejoin["step"]
        )
    assert all(r["failed"] == [] for r in run.records if r["step"] >= rejoins[1]["step"])
    assert all(
        r["failed"] == [] for r in run.records if rejoins[0]["step"] <= r["step"] < second["step"]
    )


def test_process_workers_follow_the_mesh_layout():
    # 2x2 over 4 processes of one device: row-major, process i holds device i-1.
    assert [process_workers(i, 1, (2, 2, 1)) for i in range(1, 5)] == [
        [[0, 0]],
        [[0, 1]],
        [[1, 0]],
        [[1, 1]],
    ]
    # 2x2x2 over 2 processes of 4 devices: each process holds one replica.
    assert process_workers(1, 4, (2, 2, 2)) == [[0, 0], [0, 1]]
    assert process_workers(2, 4, (2, 2, 2)) == [[1, 0], [1, 1]]


def test_recovery_settings():
    cpu = recovery_settings("cpu", 4, 6)
    assert cpu["config"] == {
        "jax_enable_recoverability": True,
        "jax_cpu_collectives_implementation": "gloo",
    }
    assert cpu["xla_flags"] == ["--xla_cpu_collective_timeout_seconds=6"]
    assert cpu["initialize"] == {"heartbeat_timeout_seconds": 4}
    gpu = recovery_settings("gpu")
    assert "--xla_gpu_nccl_terminate_on_error=false" in gpu["xla_flags"]
    assert gpu["env"]["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] == "1"
    with pytest.raises(OptionError, match="platform"):
        recovery_settings("tpu")
    with pytest.raises(OptionError, match="collective_timeout_s"):
        recovery_settings("cpu", collective_timeout_s=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--processes", "3"], "do not split evenly"),
        (["--processes", "2", "--devices-per-process", "1"], "needs 4"),
        (["--processes", "4", "--fail", "2:0:1"], "--fail injects"),
        (["--mesh", "2x2x2", "--processes", "8", "--checkpoint-dir", "ckpt"], "span processes"),
        (["--mesh", "2x2x2", "--processes", "8", "--restart"], "--restart (it restarts from"),
        (["--restart"], "add --processes N"),
    ],
)
def test_bad_process_options_are_refused(capsys, extra, message):
    code = main(["train", "--model", "mlp", "--mesh", "2x2", "--steps", "2", *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


class FakeDevice:
    """A device of another process, as LiveDevices sees it."""

    def __init__(self, process_index: int):
        self.process_index = process_index


def live_devices_over(owner: dict[tuple[int, int], int]) -> LiveDevices:
    """LiveDevices whose worker (r, s) is a device of process owner[(r, s)]."""
    detector = LiveDevices.__new__(LiveDevices)
    detector.worker_of = {FakeDevice(p): Worker(*w) for w, p in owner.items()}
    return detector


def test_live_devices_plans_each_other_process_death_that_leaves_every_stage():
    one_each = live_devices_over({(0, 0): 1, (0, 1): 2, (1, 0): 3, (1, 1): 4})
    assert one_each.planned(1) == [
        frozenset({Worker(0, 1)}),
        frozenset({Worker(1, 0)}),
        frozenset({Worker(1, 1)}),
    ]
    by_replica = live_devices_over({(0, 0): 1, (0, 1): 1, (1, 0): 2, (1, 1): 2})
    assert by_replica.planned(1) == [frozenset({Worker(1, 0), Worker(1, 1)})]
    # Process 1 holds both replicas of stage 0: its death cannot be trained around.
    by_stage = live_devices_over({(0, 0): 1, (1, 0): 1, (0, 1): 2, (1, 1): 2})
    assert by_stage.planned(2) == [] and by_stage.planned(1) == []
