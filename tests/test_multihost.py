"""Multi-controller: two CPU processes with 4 devices each run one pipelined value_and_grad.

The 2x4 mesh puts one replica on each process (the 'data' axis crosses
processes, gloo collectives). Each process writes its loss and gradients;
both must equal jax.value_and_grad of the unpipelined model in this process.
"""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models import ResidualMLP, mse_loss

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

WORKER = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process)

    import pjit_pipe as pp
    from models import ResidualMLP, mse_loss

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16)).astype(np.float32)
    y = rng.normal(size=(16, 8)).astype(np.float32)
    model = ResidualMLP()
    params = jax.device_get(model.init(jax.random.key(0), x))
    pm = pp.pipeline(model, stages=4, microbatches=4, schedule="1f1b",
                     mesh=pp.make_mesh(data=2, stage=4))
    loss, grads = pm.value_and_grad(mse_loss)(params, x, y)
    local = lambda a: np.asarray(a.addressable_data(0))
    leaves = [local(g) for g in jax.tree.leaves(grads)]
    np.savez(out, loss=local(loss), *leaves)
    jax.distributed.shutdown()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    port = free_port()
    outs = [tmp_path / f"out{i}.npz" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(port), str(outs[i])],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [(p.communicate()[0] or "")[-2000:] for p in procs]
        raise AssertionError(
            f"multi-process run exceeded {TIMEOUT_S}s; output tails: {tails}"
        ) from None
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{log[-3000:]}"

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16)).astype(np.float32)
    y = rng.normal(size=(16, 8)).astype(np.float32)
    model = ResidualMLP()
    params = model.init(jax.random.key(0), x)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: mse_loss(model.apply(p, x), y))(params)
    ref_leaves = jax.tree.leaves(ref_grads)
    for i, out in enumerate(outs):
        got = np.load(out)
        np.testing.assert_allclose(got["loss"], ref_loss, rtol=1e-5, err_msg=f"process {i} loss")
        for j, ref in enumerate(ref_leaves):
            scale = float(jnp.max(jnp.abs(ref))) + 1e-30
            err = float(np.max(np.abs(got[f"arr_{j}"] - np.asarray(ref)))) / scale
            assert err < 1e-5, f"process {i}, gradient leaf {j}: relative error {err}"
