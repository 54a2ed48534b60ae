"""The emulated run on one process per device: a multi-controller runtime.

`emulate_processes` starts D*P Python processes on this host, each with one
CPU device, joined by `jax.distributed` on localhost with gloo collectives,
the way a GPU cluster runs one process per GPU. Each runs the same emulated
program (runtime/emulation.py); a collective-permute between processes is
then a send/recv between the pairs it names (gloo's CollectivePermute), not a
rendezvous of every device. Each process writes the times of its device's
ops, and the period is measured over all of them: `time.perf_counter` reads
one clock for every process of a host.

A failed worker's process (a re-routed schedule) joins the group and runs
nothing: the program runs on the survivors' devices (lowering/comms/topology.py).
Run as `python -m pjit_pipe.runtime.emulate_processes DIR RANK COUNT PORT`,
a process reads its job from DIR/job.pkl (written by `emulate_processes`).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.runtime.local_processes import PACKAGE_ROOT, free_port, local_process_env

TIMEOUT_S = 600


def emulate_processes(
    table: PackedTicks, costs: Costs, unit_ms: float, pairwise: bool = True
) -> float:
    """The measured steady period (cost units) of `table` run by D*P processes of one
    device each, each op sleeping its cost x `unit_ms` milliseconds. `pairwise`:
    each tick's ppermutes name only its messages' pairs (lowering.plan)."""
    from pjit_pipe.runtime.emulation import steady_period

    schedule = table.schedule
    count = schedule.replicas * schedule.stages
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "job.pkl").write_bytes(pickle.dumps((table, costs, unit_ms, pairwise)))
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", __name__, tmp, str(rank), str(count), port],
                env=local_process_env(1),
                cwd=PACKAGE_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(count)
        ]
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise ChildProcessError(
                f"emulate --processes: the {count} processes ran past {TIMEOUT_S} s"
            ) from None
        bad = [(i, p.returncode, log) for i, (p, log) in enumerate(zip(procs, logs, strict=True))]
        bad = [b for b in bad if b[1] != 0]
        if bad:
            rank, code, log = bad[0]
            tail = " | ".join(log.strip().splitlines()[-3:])
            raise ChildProcessError(f"emulate --processes: process {rank} exited {code}: {tail}")
        records = []
        for rank in range(count):
            records += json.loads((Path(tmp) / f"records{rank}.json").read_text())
    return steady_period(records, unit_ms / 1000)


def _run(directory: str, rank: int, count: int, port: str) -> None:
    """One process of `emulate_processes`: join the group, run, write its records."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=count, process_id=rank)

    import numpy as np
    from jax.sharding import AxisType, Mesh

    from pjit_pipe.lowering import AXES
    from pjit_pipe.runtime.emulation import SleepingHost, emulated_step

    table, costs, unit_ms, pairwise = pickle.loads((Path(directory) / "job.pkl").read_bytes())
    schedule = table.schedule
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    grid = np.array(devices, dtype=object).reshape(schedule.replicas, schedule.stages)
    host = SleepingHost.of(table, costs, unit_ms / 1000)
    live = {(w.replica, w.stage) for w in schedule.alive_workers}
    if divmod(rank, schedule.stages) in live:  # grid.flat[rank] is this process's device
        mesh = Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 2)
        step, args = emulated_step(table, host, mesh, pairwise)
        jax.block_until_ready(step.train_step(*args))
    (Path(directory) / f"records{rank}.json").write_text(json.dumps(host.records))
    jax.distributed.shutdown()


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
