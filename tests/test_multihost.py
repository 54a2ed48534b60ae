"""Multi-controller: two CPU processes with 4 devices each run one pipelined value_and_grad,
then train, save a checkpoint and restore it.

The first 2x4 mesh puts one replica on each process (the 'data' axis crosses
processes, gloo collectives). Each process writes its loss and gradients;
both must equal jax.value_and_grad of the unpipelined model in this process.
Then both processes train two adam steps on the same mesh, save a checkpoint
and restore it: each device holds only its stage's state, and each process
writes the shards it holds (orbax splits a replicated array's writing among
its replicas, here one per process).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.runtime import free_port, local_process_env

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
    from pjit_pipe.models import ResidualMLP, mse_loss

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

    import optax
    from pjit_pipe.runtime.checkpoint import Checkpoints

    mesh = pp.make_mesh(data=2, stage=4)
    pt = pp.pipeline(model, stages=4, microbatches=4, mesh=mesh, optimizer=optax.adam(1e-2))
    step = pt.train_step(mse_loss, donate=False)
    state = step.init(params, (x, y))
    losses = []
    for _ in range(2):
        state, l = step(state, (x, y))
        losses.append(local(l))
    checkpoints = Checkpoints(sys.argv[4], every=1)
    checkpoints.save(state, {"position": 2})
    checkpoints.wait()
    restored, position = checkpoints.restore(step, (x, y), jax.eval_shape(lambda: params))
    mine = lambda st: [np.asarray(s.data) for b in jax.tree.leaves(st) for s in b.addressable_shards]
    same = all(np.array_equal(a, b) for a, b in zip(mine(state), mine(restored), strict=True))
    _, after_restore = step(restored, (x, y))
    _, after_saved = step(state, (x, y))
    checkpoints.close()
    np.savez(out, *leaves, loss=local(loss), losses=np.array(losses), same=same,
             position=position["position"], step=restored.step,
             next=np.array([local(after_restore), local(after_saved)]))
    jax.distributed.shutdown()
    """
)


def test_two_processes_match_one(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = local_process_env(4)  # 4 CPU devices, no persistent compilation cache
    port = free_port()
    outs = [tmp_path / f"out{i}.npz" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(port), str(outs[i]), str(tmp_path / "ckpt")],
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
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: mse_loss(model.apply(p, x), y)))(
        params
    )
    ref_leaves = jax.tree.leaves(ref_grads)
    opt = optax.adam(1e-2)
    p, o, train_losses = params, opt.init(params), []
    ref_value_and_grad = jax.jit(jax.value_and_grad(lambda p: mse_loss(model.apply(p, x), y)))
    for _ in range(2):
        loss, g = ref_value_and_grad(p)
        upd, o = opt.update(g, o, p)
        p = optax.apply_updates(p, upd)
        train_losses.append(float(loss))
    state_dir = tmp_path / "ckpt" / "2" / "state"
    for i in range(2):  # each process wrote array data of its own
        assert any((state_dir / f"ocdbt.process_{i}" / "d").iterdir()), f"process {i} wrote none"
    for i, out in enumerate(outs):
        got = np.load(out)
        np.testing.assert_allclose(got["losses"], train_losses, rtol=1e-5, err_msg=f"process {i}")
        assert got["same"] and int(got["step"]) == 2 and int(got["position"]) == 2
        assert got["next"][0] == got["next"][1], f"process {i}: restored state trains differently"
        np.testing.assert_allclose(got["loss"], ref_loss, rtol=1e-5, err_msg=f"process {i} loss")
        for j, ref in enumerate(ref_leaves):
            scale = float(jnp.max(jnp.abs(ref))) + 1e-30
            err = float(np.max(np.abs(got[f"arr_{j}"] - np.asarray(ref)))) / scale
            assert err < 1e-5, f"process {i}, gradient leaf {j}: relative error {err}"
