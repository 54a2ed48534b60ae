"""`pjit-pipe train --processes N`: one training run over N local processes, as on a cluster.

The launcher (this module's `launch`, inside the `pjit-pipe train` process)
starts N + 1 Python processes over `jax.distributed` on localhost:

- process 0, the coordinator, joins with one CPU device that no mesh uses and
  only hosts JAX's coordination service. The service dies with the process
  that hosts it, and every other process with it (DESIGN notes); a
  coordinator that trains nothing has no step to fail in, so the death of any
  training process leaves the job alive.
- processes 1..N each own K CPU devices (gloo collectives) and run the same
  `train` as one process does, with the mesh over all their devices: process
  i holds mesh devices (i-1)K .. iK-1 in the mesh's row-major order. Each
  joins with `initialize_distributed`, so a process that dies is detected
  (`LiveDevices`) and its workers' microbatches move to their peers.

Each training process reports to the launcher in JSON lines on its stdout
(its own prints go to stderr); the launcher prints each committed step once,
as one process would, and appends the events to `--events FILE`. A training
process's death is not an error: the run succeeds when every step up to
`--steps` was committed (from the checkpoint's step, with `--checkpoint-dir`),
every process that finished committed each of the last start's steps, and all
reported the same loss for each.

With `--restart` a death restarts the job (`_Job`, one start of it): the
survivors stop together at a step (`PlannedStop`, asked by a line on their
stdin), save it and leave, and all N processes start again from it, the dead
one rejoining there; the coordinator's death restarts the job from the
newest checkpoint.

Run as `python -m pjit_pipe.cli.train_processes DIR RANK`, a process reads its
arguments from DIR/args.pkl (written by `launch`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from pjit_pipe.cli.process_events import Events
from pjit_pipe.runtime import PACKAGE_ROOT, free_port, local_process_env

COORDINATOR = 0  # the process that hosts the coordination service and trains nothing
EXIT_WAIT_S = 30  # how long the launcher waits for a process that finished to exit


def worker_of_index(index: int, mesh: tuple[int, int, int]) -> tuple[int, int]:
    """The (replica, stage) worker of the mesh's device number `index` (row-major
    over (data, stage, tensor), as `make_mesh` lays devices out)."""
    _, stages, tensor = mesh
    return index // (stages * tensor), (index // tensor) % stages


def process_workers(rank: int, k: int, mesh: tuple[int, int, int]) -> list[list[int]]:
    """The workers training process `rank` (1..N) runs, each once, sorted."""
    found = {worker_of_index(i, mesh) for i in range((rank - 1) * k, rank * k)}
    return [list(w) for w in sorted(found)]


class _Job:
    """One start of the job: the coordinator and N training processes, each training
    process's report lines read into one queue as (rank, line), None at its end."""

    def __init__(self, directory: str, n: int, k: int):
        command = [sys.executable, "-m", __name__, directory]
        port = free_port()
        self.coordinator = subprocess.Popen(
            [*command, str(COORDINATOR), str(n + 1), str(port)],
            env=local_process_env(1),
            cwd=PACKAGE_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        self.workers = {
            rank: subprocess.Popen(
                [*command, str(rank), str(n + 1), str(port), str(k)],
                env=local_process_env(k),
                cwd=PACKAGE_ROOT,
                stdin=subprocess.PIPE,  # a line there asks it to stop with the others
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(1, n + 1)
        }
        self.lines: queue.Queue = queue.Queue()
        for rank, proc in self.workers.items():
            threading.Thread(target=self._read, args=(rank, proc.stdout), daemon=True).start()
        self.reported: dict[int, set[int]] = {rank: set() for rank in self.workers}
        self.stopped_at: int | None = None  # the step a planned stop saved and left at

    def reported_first(self) -> int:
        """The first step any of this job's processes committed (sys.maxsize if none)."""
        return min((min(steps) for steps in self.reported.values() if steps), default=sys.maxsize)

    def _read(self, rank: int, stream: TextIO) -> None:
        for line in stream:
            self.lines.put((rank, line))
        self.lines.put((rank, None))

    def ask_to_stop(self) -> None:
        """Ask every live training process to stop with the others (PlannedStop)."""
        for proc in self.workers.values():
            if proc.poll() is None:
                with contextlib.suppress(OSError):  # it died since: a broken pipe
                    proc.stdin.write("stop\n")
                    proc.stdin.flush()

    def end(self) -> dict[int, int]:
        """Kill what is left, let the coordinator go; each training process's exit code."""
        codes = {rank: _exit_code(proc) for rank, proc in self.workers.items()}
        self.coordinator.stdin.close()  # its signal to leave
        try:
            self.coordinator.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self.coordinator.kill()
        return codes

    def kill(self) -> None:
        for proc in [*self.workers.values(), self.coordinator]:
            if proc.poll() is None:
                proc.kill()


def launch(args: argparse.Namespace) -> int:
    """Run `args` (a parsed `pjit-pipe train --processes N` command line) over N
    local training processes and a coordinator; print as one process would.

    With `--restart`, the job restarts as a whole when a training process dies
    (after the survivors have stopped together at one step and saved it: the
    dead process rejoins there, a `rejoin` event) or when the coordinator dies
    (from the newest checkpoint; the steps after it run again and must give
    the same losses).

    Returns:
        0 when every step up to --steps was committed, else 1 (with a line on stderr).

    Raises:
        UsageError: --processes and --devices-per-process do not fit the mesh, or
            an option that needs one process.
    """
    from pjit_pipe.cli.train import StepRecord, step_printer
    from pjit_pipe.cli.train_args import check_process_args

    k = check_process_args(args)
    n = args.processes
    on_step, close = step_printer(args)
    events = Events(args.events)
    losses: dict[int, float] = {}  # committed step -> its loss, as first reported
    disagree: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pjit_pipe-processes-") as tmp:
        if args.restart and not args.checkpoint_dir:  # where the job restarts from
            args.checkpoint_dir = str(Path(tmp) / "checkpoints")
        (Path(tmp) / "args.pkl").write_bytes(pickle.dumps(args))
        job = _Job(tmp, n, k)
        try:
            while True:
                coordinator = {"event": "process", "t": time.time(), "process": COORDINATOR}
                events.add({**coordinator, "pid": job.coordinator.pid, "workers": []})
                died = _run(job, args, events, losses, disagree, on_step, StepRecord)
                codes = job.end()
                _note_deaths(job, codes, args.restart)
                if not args.restart or not (died or job.coordinator.returncode):
                    break
                if job.stopped_at is not None and died:
                    workers = [w for r in sorted(died) for w in process_workers(r, k, args.mesh)]
                    event = {"event": "rejoin", "t": time.time(), "step": job.stopped_at}
                    events.add({**event, "workers": workers})
                if job.stopped_at is None and max(losses, default=-1) >= args.steps - 1:
                    break  # the last step was committed before the death
                job = _Job(tmp, n, k)
        finally:
            close()
            events.close()
            job.kill()
    # A run resumed from a checkpoint starts at its step (none: nothing left to run).
    first = min(losses, default=args.steps if all(c == 0 for c in codes.values()) else 0)
    missing = sorted(set(range(first, args.steps)) - set(losses))
    mine = set(range(min(job.reported_first(), args.steps), args.steps))
    short = [r for r, code in codes.items() if code == 0 and job.reported[r] != mine]
    problem = None
    if missing:
        problem = f"the processes ended (exit codes {list(codes.values())}) before step {missing[0]} was committed"
    elif disagree:
        problem = f"processes disagree on a committed loss: {disagree[0]}"
    elif short:
        problem = f"process {short[0]} finished without committing every step"
    if problem:
        print(f"error: pjit-pipe train: {problem}", file=sys.stderr)
        return 1
    return 0


def _run(
    job: _Job,
    args: argparse.Namespace,
    events: Events,
    losses: dict,
    disagree: list,
    on_step: Any,
    record: Any,
) -> set[int]:
    """Read one job's reports until every training process's stream has ended,
    printing each committed step once (the first report of it).

    Returns:
        The training processes that died (ended by a signal). With --restart, the
        first death asks the others to stop together (`_Job.ask_to_stop`).
    """
    died: set[int] = set()
    open_streams, deadline = len(job.workers), None
    while open_streams:
        try:
            rank, line = job.lines.get(timeout=1.0)
        except queue.Empty:
            if deadline is not None and time.monotonic() > deadline:
                _stop_stragglers(list(job.workers.values()))  # their streams close next
                deadline = None
            continue
        if line is None:
            open_streams -= 1
            if _exit_code(job.workers[rank]) < 0:
                died.add(rank)
                if args.restart and job.stopped_at is None:
                    job.ask_to_stop()
            continue
        try:
            event = json.loads(line)
        except ValueError:
            print(line, end="", file=sys.stderr)  # not a report: pass it on
            continue
        if event["event"] == "stopped":
            job.stopped_at = event["step"]
            continue
        if event["event"] == "step":  # every survivor commits the same
            step, loss = event["step"], event["loss"]
            job.reported[rank].add(step)
            if step in losses and abs(loss - losses[step]) > 1e-6 * abs(losses[step]):
                disagree.append(f"step {step}: process {rank} {loss}, else {losses[step]}")
            losses.setdefault(step, loss)
            if step == args.steps - 1 and deadline is None:
                deadline = time.monotonic() + EXIT_WAIT_S
        if events.add(event) and event["event"] == "step":
            on_step(record(**event["record"]))
    return died


def _note_deaths(job: _Job, codes: dict[int, int], restart: bool) -> None:
    """A note on stderr for each process of `job` that died, and what followed."""
    lost = job.coordinator.returncode
    if lost:  # the coordination service went with it, and every process after it
        how = f"by {signal.Signals(-lost).name}" if lost < 0 else f"with exit code {lost}"
        then = "; the job restarts from the newest checkpoint" if restart else ""
        print(
            f"note: the coordinator (process 0, pid {job.coordinator.pid}) ended {how}, "
            f"and every training process with it{then}",
            file=sys.stderr,
        )
        return
    for rank, code in codes.items():
        if code < 0:
            then = "training went on without it"
            if job.stopped_at is not None:
                then += f", and it rejoins at step {job.stopped_at}"
            print(
                f"note: process {rank} (pid {job.workers[rank].pid}) ended by "
                f"{signal.Signals(-code).name}; {then}",
                file=sys.stderr,
            )


def _stop_stragglers(workers: list[subprocess.Popen]) -> None:
    """Kill the training processes still running EXIT_WAIT_S after the last step
    was committed: one stopped past the timeouts and resumed may wait forever on
    a job that has moved on without it."""
    for rank, proc in enumerate(workers, start=1):
        if proc.poll() is None:
            print(
                f"note: process {rank} (pid {proc.pid}) is still running {EXIT_WAIT_S} s "
                "after the last step was committed; stopping it",
                file=sys.stderr,
            )
            proc.kill()


def _exit_code(proc: subprocess.Popen) -> int:
    """A training process's exit code, once its reports have ended (killed if it
    does not exit within EXIT_WAIT_S of that)."""
    try:
        return proc.wait(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _report(out: TextIO, event: str, **fields: Any) -> None:
    out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    out.flush()


def _train(directory: str, rank: int, count: int, port: str, k: int) -> None:
    """A training process: join the job, report itself, train, report each step."""
    import dataclasses

    out = os.fdopen(os.dup(1), "w")  # the reports go to the launcher...
    os.dup2(2, 1)  # ...and anything else printed to stderr
    from pjit_pipe.runtime import PlannedStop, initialize_distributed

    initialize_distributed(f"localhost:{port}", count, rank)
    import jax

    from pjit_pipe.cli.train import train

    args = pickle.loads((Path(directory) / "args.pkl").read_bytes())
    # With --restart the launcher asks for a planned stop by a line on stdin
    # (`_Job.ask_to_stop`); without, no step reads the key-value store.
    stop = PlannedStop() if args.restart else None

    def listen() -> None:
        if sys.stdin.readline():
            stop.request()

    if stop is not None:
        threading.Thread(target=listen, daemon=True).start()
    devices = sorted(
        (d for d in jax.devices() if d.process_index != COORDINATOR),
        key=lambda d: (d.process_index, d.id),
    )
    _report(
        out, "process", process=rank, pid=os.getpid(), workers=process_workers(rank, k, args.mesh)
    )

    def on_step(record: Any) -> None:
        _report(out, "step", step=record.step, loss=record.loss, record=dataclasses.asdict(record))

    def on_event(event: Any) -> None:
        if event.kind in ("failure", "switch"):
            failed = [list(w) for w in sorted(event.failed)]
            _report(out, event.kind, step=event.step, failed=failed)

    train(args, on_step, devices=devices, on_trainer_event=on_event, stop=stop)
    if stop is not None and stop.agreed is not None and stop.agreed < args.steps:  # saved, left
        _report(out, "stopped", step=stop.agreed)
    out.close()
    # Leave without jax.distributed.shutdown: its barrier would wait for the dead
    # processes and for the coordinator, which leaves only when every process has.
    os._exit(0)


def _coordinate(count: int, port: str) -> None:
    """Process 0: host the coordination service until the launcher closes stdin."""
    from pjit_pipe.runtime import initialize_distributed

    initialize_distributed(f"localhost:{port}", count, COORDINATOR)
    import jax

    jax.devices()  # every process's backend publishes its devices before any starts
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    _dir, _rank, _count, _port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if _rank == COORDINATOR:
        _coordinate(_count, _port)
    else:
        _train(_dir, _rank, _count, _port, int(sys.argv[5]))
