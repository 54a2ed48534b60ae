"""A real process death on a multi-process run: `pjit-pipe train --processes N`, one
training process killed with SIGKILL mid-run (by its pid from the events file), or
stopped with SIGSTOP past the timeouts and resumed; with `--restart`, a killed
process rejoining (the job restarted at a step the survivors saved) and the
coordinator killed (the job restarted from its newest checkpoint).

Prints, per scenario: the time from the kill to the failure's detection (the
survivors' `failure` event), to the first step committed after it, and the
steps lost (committed steps missing from 0 .. --steps - 1; 0 when training
went on); first, what a checkpoint of `ProcessCheckpoints` costs (copy, write,
restore, at ZeRO 0, 1 and 3; `--checkpoints-only` for those alone). Run `python -m
benchmarks.bench_process_failure`; each scenario
compiles afresh (about two minutes on 2 cores): JAX writes its disk cache from
process 0 alone, here the coordinator, which compiles nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class KillRun:
    """What one run with a kill gave."""

    returncode: int
    records: list[dict]  # the CLI's --json lines
    events: list[dict]  # the --events file
    killed_pid: int | None
    killed_at: float | None  # unix seconds
    stderr: str = ""
    workers: dict[int, list] = field(default_factory=dict)  # process -> its workers
    then_killed_at: float | None = None  # the second kill (run_with_kill's `then`)

    def first_after_kill(self, kind: str) -> dict | None:
        """The first event of `kind` recorded after the kill."""
        if self.killed_at is None:
            return None
        later = [e for e in self.events if e["event"] == kind and e["t"] >= self.killed_at]
        return min(later, key=lambda e: e["t"], default=None)


def read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def run_with_kill(
    folder: Path,
    train_args: list[str],
    victim: int | None,
    after_step: int,
    timeout_s: float,
    cache_dir: Path,
    stop_s: float | None = None,
    then: int | None = None,
) -> KillRun:
    """Run `pjit-pipe train <train_args> --json --events ...` and SIGKILL training
    process `victim` (None: nobody) once step `after_step` is committed (with
    `stop_s`: SIGSTOP it, and SIGCONT `stop_s` seconds later). With `then` (and
    --restart), SIGKILL training process `then` of the restarted job too, once it
    has committed its first step after the rejoin. The whole process group is
    killed at the end, whatever happens; past `timeout_s` the run is stopped and
    TimeoutError raised with the output so far."""
    events_file = folder / "events.jsonl"
    err_file = folder / "stderr.txt"
    command = [sys.executable, "-m", "pjit_pipe", "train", *train_args, "--json"]
    command += ["--events", str(events_file), "--cache-dir", str(cache_dir)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    with open(err_file, "w") as err:
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    killed_pid = killed_at = then_killed_at = None
    start = time.monotonic()

    def waiting() -> bool:
        return victim is not None and (killed_pid is None or then_killed_at is None)

    try:
        while waiting() and proc.poll() is None:
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"no step {after_step} within {timeout_s} s")
            events = read_events(events_file)
            pids = {e["process"]: e["pid"] for e in events if e["event"] == "process"}
            if killed_pid is not None:  # `then`'s kill, once the restarted job commits
                rejoined = [e["t"] for e in events if e["event"] == "rejoin"]
                if rejoined and any(e["event"] == "step" and e["t"] > rejoined[0] for e in events):
                    os.kill(pids[then], signal.SIGKILL)  # the latest start's pid
                    then_killed_at = time.time()
            elif any(e["event"] == "step" and e["step"] >= after_step for e in events):
                killed_pid = pids[victim]
                os.kill(killed_pid, signal.SIGSTOP if stop_s else signal.SIGKILL)
                killed_at = time.time()
                if stop_s:  # a stall, not a death: it runs again after stop_s
                    time.sleep(stop_s)
                    os.kill(killed_pid, signal.SIGCONT)
                if then is None:
                    then_killed_at = killed_at  # nothing more to wait for
            time.sleep(0.01)
        try:
            out, _ = proc.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the run went past {timeout_s} s") from None
    except TimeoutError as e:
        raise TimeoutError(f"{e}; stderr tail: {err_file.read_text()[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    events = read_events(events_file)
    return KillRun(
        proc.returncode,
        [json.loads(line) for line in out.splitlines() if line.startswith("{")],
        events,
        killed_pid,
        killed_at,
        err_file.read_text(),
        {e["process"]: e["workers"] for e in events if e["event"] == "process"},
        then_killed_at if then is not None else None,
    )


MLP_2X2 = ["--model", "mlp", "--mesh", "2x2", "--schedule", "1f1b", "--microbatches", "2"]
MLP_2X2 += ["--steps", "40", "--processes", "4"]
SCENARIOS = {  # name -> (train args, victim process, after this step is committed, stop_s)
    "2x2 mlp 1f1b, 4 processes, process 2 killed": (MLP_2X2, 2, 3, None),
    "2x2 mlp 1f1b, 4 processes, process 1 (the first training process) killed": (
        MLP_2X2,
        1,
        3,
        None,
    ),
    "2x2 mlp 1f1b, 4 processes, process 2 stopped for 12 s (SIGSTOP, then SIGCONT)": (
        MLP_2X2,
        2,
        3,
        12.0,
    ),
    "2x2 mlp 1f1b, 4 processes --restart, process 2 killed and rejoined": (
        [*MLP_2X2, "--restart"],
        2,
        3,
        None,
    ),
    "2x2 mlp 1f1b, 4 processes --restart, the coordinator (process 0) killed": (
        [*MLP_2X2, "--restart", "--checkpoint-every", "4"],
        0,
        3,
        None,
    ),
}


def checkpoint_costs(model: str, zero: int = 0, repeats: int = 5) -> dict[str, float]:
    """`ProcessCheckpoints` on a 2x2 `model` at ZeRO level `zero` in this process (4
    CPU devices, so one copy holds both stages, where a process of the 4-process
    run holds one; under ZeRO each device's slices are saved apart):
    the median seconds to copy a step's leaves off the devices (what the
    training thread waits for), to write them (the background thread), and to
    restore them into the step's layout (a resumed run's share, no compile);
    the first save's, unpack ops compiling, apart."""
    import statistics
    import tempfile

    import jax
    import optax

    import pjit_pipe as pp
    from pjit_pipe.cli.train import make_task
    from pjit_pipe.runtime import ProcessCheckpoints

    task = make_task(model, 8, seed=0)
    x, y = task.next_batch()
    mesh = pp.make_mesh(data=2, stage=2, devices=jax.devices()[:4])
    pm = pp.pipeline(
        task.model, stages=2, microbatches=2, mesh=mesh, optimizer=optax.adam(3e-3), zero=zero
    )
    step = pm.train_step(task.loss_fn, donate=False)
    state = step.init(jax.jit(pm.init)(jax.random.key(0), x), (x, y))
    state, _ = step(state, (x, y))
    like = jax.eval_shape(pm.init, jax.random.key(0), x)
    times: dict[str, list[float]] = {"copy": [], "write": [], "restore": []}
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = ProcessCheckpoints(folder, every=1, keep=None)
        for k in range(repeats + 1):
            start = time.perf_counter()
            checkpoints.save(state.replace(step=k + 1))
            copied = time.perf_counter()
            checkpoints.wait()
            written = time.perf_counter()
            checkpoints.restore(step, (x, y), like, step=k + 1)
            restored = time.perf_counter()
            times["copy"].append(copied - start)
            times["write"].append(written - copied)
            times["restore"].append(restored - written)
    out = {name: statistics.median(t[1:]) for name, t in times.items()}
    return {**out, "first copy": times["copy"][0]}


def save_step_cost(folder: Path, timeout_s: float, cache_dir: Path) -> tuple[float, float]:
    """The 2x2 mlp over 4 processes saving every 4 steps: (median seconds between
    two committed steps across a save, median between others), from the events
    file's times, steps 5 on (compiles and the first save's own compile done)."""
    import itertools
    import statistics

    args = [*MLP_2X2, "--checkpoint-dir", str(folder / "ckpt"), "--checkpoint-every", "4"]
    run = run_with_kill(folder, args, None, 0, timeout_s, cache_dir)
    steps = [e for e in run.events if e["event"] == "step"]
    gaps = {b["step"]: b["t"] - a["t"] for a, b in itertools.pairwise(steps)}
    across = [g for s, g in gaps.items() if s > 4 and s % 4 == 0]  # step s follows the save
    return statistics.median(across), statistics.median(
        [g for s, g in gaps.items() if s > 4 and s % 4]
    )


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "bench_pf"))
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--checkpoints-only", action="store_true", help="only the checkpoint costs (seconds)"
    )
    parser.add_argument(
        "--only", default=None, metavar="TEXT", help="only the kill scenarios naming TEXT"
    )
    args = parser.parse_args()
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:  # checkpoint_costs' 4 devices
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    import jax

    print(f"jax {jax.__version__}, cache {args.cache_dir}")
    for model, zero in itertools.product(("mlp", "gpt-tiny"), (0, 1, 3)):
        if args.only is not None:
            break
        costs = checkpoint_costs(model, zero)
        print(
            f"ProcessCheckpoints, 2x2 {model} zero {zero} in one process (both stages): copy off the "
            f"devices {costs['copy'] * 1e3:.1f} ms (first save {costs['first copy']:.2f} s), "
            f"write {costs['write'] * 1e3:.1f} ms, restore {costs['restore'] * 1e3:.1f} ms"
        )
    if args.checkpoints_only:
        return
    if args.only is None:
        with tempfile.TemporaryDirectory() as tmp:
            across, other = save_step_cost(Path(tmp), args.timeout, Path(args.cache_dir))
        print(
            f"2x2 mlp 1f1b, 4 processes, a save every 4 steps: {across * 1e3:.0f} ms between "
            f"the steps around a save, {other * 1e3:.0f} ms between others (medians)"
        )
    for name, (train_args, victim, after, stop_s) in SCENARIOS.items():
        if args.only is not None and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run = run_with_kill(
                Path(tmp), train_args, victim, after, args.timeout, Path(args.cache_dir), stop_s
            )
        steps = int(train_args[train_args.index("--steps") + 1])
        committed = {r["step"] for r in run.records}
        lost = len(set(range(steps)) - committed)
        failure = run.first_after_kill("failure")
        step = run.first_after_kill("step")
        detect = f"{failure['t'] - run.killed_at:.2f} s" if failure else "none"
        next_step = f"{step['t'] - run.killed_at:.2f} s" if step else "none"
        print(
            f"{name}: exit {run.returncode}; kill -> failure detected {detect}, -> next "
            f"committed step {next_step}; steps lost {lost}{_restart_times(run)}"
        )


def _restart_times(run: KillRun) -> str:
    """With --restart: from the restarted job's launch (its coordinator's `process`
    event, written as the launcher starts its processes) to the first step committed
    for the first time (after a restart from a checkpoint, the steps run again come
    first)."""
    starts = sorted(e["t"] for e in run.events if e["event"] == "process" and e["process"] == 0)
    if len(starts) < 2:
        return ""
    rejoin = next((e for e in run.events if e["event"] == "rejoin"), None)
    restarted = starts[-1]
    seen = {e["step"] for e in run.events if e["event"] == "step" and e["t"] < restarted}
    later = [
        e["t"]
        for e in run.events
        if e["event"] == "step" and e["t"] > restarted and e["step"] not in seen
    ]
    first = f"{min(later) - restarted:.1f} s" if later else "none"
    where = f"rejoin at step {rejoin['step']}; " if rejoin else ""
    return f"; {where}restarted job launched -> first newly committed step {first}"


if __name__ == "__main__":
    main()
