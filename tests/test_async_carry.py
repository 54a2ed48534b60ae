"""Asynchronous 1F1B across compiled calls: the carrying program (lowering/async_pipeline/async_carry.py).

N carrying calls and a flush run each worker's ops in the order of one call of
N iterations, so they must give its parameters and per-batch losses; with a
message crossing the window's end (remat) they must match the op-by-op host
replay of asynchronous training (tests/test_async_lowering.py). Without a
compile, a replay of the window's plan on labels checks that every op of
several calls reads the tensor it needs; the CLI carries between steps.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.cli import main
from pjit_pipe.errors import OptionError, StateError
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.lowering.async_pipeline.steady_window import CURRENT, PREVIOUS, steady_window
from pjit_pipe.lowering.tick_plan import LANE_OF
from pjit_pipe.models import ResidualMLP, mse_loss
from pjit_pipe.runtime.checkpoint import CheckpointError, Checkpoints
from pjit_pipe.schedules import make_schedule
from tests.test_async_lowering import ITERS, host_async_training
from tests.test_async_lowering import M as ASYNC_M
from tests.test_lowering import MB, assert_trees_close, batch, mesh_of, tiny_model, xent

P, M, CALLS = 4, 4, 3


def carry_and_drain(step, params, batches):
    """(per-stage params, loss of each batch) after one carrying call per batch and a drain."""
    dev_params, dev_opt = step.layout.from_stages(params, step.init_opt_state(params))
    in_flight, losses = None, []
    for x, y in batches:
        dev_params, dev_opt, in_flight, loss = step.carry_train_step(
            dev_params, dev_opt, in_flight, x, y
        )
        assert in_flight is not None
        losses.append(float(loss))
    dev_params, dev_opt, in_flight, loss = step.carry_train_step(
        dev_params, dev_opt, in_flight, drain=True
    )
    assert in_flight is None and np.isnan(losses[0])  # the first call finishes no batch
    got, _ = step.layout.to_stages(dev_params, dev_opt)
    return got, [*losses[1:], float(loss)]


@pytest.mark.filterwarnings("ignore:.*imbalanced")  # ResidualMLP's 4-stage cut
def test_calls_and_flush_equal_one_call_of_n_iterations(tmp_path):
    """1x4, stash (the versions in flight move with their residual slots), through
    the frontend's carrying TrainStep; the state in flight is refused by a
    checkpoint and by a draining step."""
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32))
        for _ in range(CALLS)
    ]
    optimizer = optax.adam(0.02)
    pm = pp.pipeline(
        ResidualMLP(n_layers=2),
        stages=P,
        microbatches=M,
        schedule="async-1f1b",
        async_weights="stash",
        mesh=pp.make_mesh(data=1, stage=P),
        optimizer=optimizer,
    )
    params = pm.init(jax.random.key(0), batches[0][0])
    carrying = pm.train_step(mse_loss, carry=True)
    state, losses = carrying.init(params, batches[0]), []
    for b in batches:
        state, loss = carrying(state, b)
        losses.append(float(loss))
    assert np.isnan(losses[0]) and state.in_flight is not None and state.step == CALLS
    with pytest.raises(CheckpointError, match="in flight"):
        Checkpoints(tmp_path).save(state, force=True)
    with pytest.raises(StateError, match="flush"):
        pm.train_step(mse_loss)(state, batches[0])
    state, loss = carrying.flush(state)
    assert state.in_flight is None and carrying.flush(state) == (state, None)

    cut = pm.cut(params, batches[0][0])
    ref = lower(
        PackedTicks.one_op_per_tick(pm.schedule, CALLS),
        cut.stage_fns(),
        mse_loss,
        pm.mesh,
        cut.split(params),
        *batches[0],
        LoweringOptions(optimizer=optimizer, async_weights="stash"),
    )
    xs, ys = (jnp.stack(b) for b in zip(*batches, strict=True))
    stage_params = cut.split(params)
    want, _, want_losses = ref.train_step(stage_params, ref.init_opt_state(stage_params), xs, ys)
    np.testing.assert_allclose([*losses[1:], float(loss)], np.asarray(want_losses), rtol=1e-5)
    assert_trees_close(cut.split(state.params), want)
    program = pm.program(params, *batches[0], mse_loss)[1]
    window = program._carrying.window
    assert window.period == 2 * M  # one F and one BW per microbatch: no bubble
    assert np.any(window.res_moves[..., 0] != window.res_moves[..., 1])

    with pytest.raises(OptionError, match="asynchronous schedule"):
        pp.pipeline(ResidualMLP(), stages=2, microbatches=2, optimizer=optimizer).train_step(
            mse_loss, carry=True
        )


@pytest.mark.slow
def test_carried_messages_and_prediction_follow_the_host_arithmetic():
    """P=2 with remat: an activation crosses the window's end (a message slot
    move), and predict carries its last update u across calls."""
    fns, params = tiny_model(2)
    batches = [batch(ASYNC_M * MB, seed=40 + i) for i in range(ITERS)]
    opt = optax.sgd(0.3, momentum=0.9)
    sched = make_schedule("async-1f1b", 2, ASYNC_M)
    step = lower(
        sched,
        fns,
        xent,
        mesh_of(1, 2),
        params,
        *batches[0],
        LoweringOptions(optimizer=opt, remat=True, async_weights="predict"),
    )
    got, losses = carry_and_drain(step, params, batches)
    window = step._carrying.window
    assert np.any(window.msg_moves[..., 0] != window.msg_moves[..., 1])
    want, want_losses = host_async_training(fns, params, opt, batches, sched, "predict")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want)


def replay(sched, remat: bool, calls: int) -> int:
    """Run the window's plan on labels instead of tensors, `calls` carrying calls and
    a drain, as the compiled program would (masks, channels, slot moves); assert that
    every op reads the tensor and input row it needs. Returns the ops run."""
    workers = tuple(sched.alive_workers)
    win = steady_window(sched, remat, workers)
    plan, rows, S = win.plan, win.plan.rows, sched.num_virtual_stages
    msgs = [[None] * (plan.msg_slots + 1) for _ in workers]
    res = [[None] * (plan.res_slots + 1) for _ in workers]
    carried_n, ran = win.carried.shape[1], 0
    for call in range(calls + 1):
        live = (call > 0, call < calls)
        for t in range(win.period):
            sent = {True: [None] * len(workers), False: [None] * len(workers)}
            for d, w in enumerate(workers):
                for _, op in win.ticks[t].get(w, ()):
                    if op.kind is Kind.OPT:
                        continue
                    lane = getattr(rows, LANE_OF[op.kind])
                    it = int(lane.iteration[d, t])
                    if not live[it]:
                        continue
                    ran += 1
                    b, s, j, r = call - 1 + it, op.stage, op.mb, op.replica
                    if s in (0, S - 1):  # reads its input row or labels
                        mb = int(lane.mb[d, t])
                        prev = mb < carried_n
                        assert it == (PREVIOUS if prev else CURRENT)
                        row = win.carried[d, mb] if prev else win.fresh[d, mb - carried_n]
                        assert tuple(row) == (r, j)
                    if s > 0 and (op.kind is Kind.F or remat):
                        assert msgs[d][lane.in_slot[d, t]] == ("act", b, s - 1, j, r)
                    if op.kind is Kind.F:
                        if not remat:
                            res[d][lane.res_w[d, t]] = ("res", b, s, j, r)
                        sent[True][d] = ("act", b, s, j, r)
                        continue
                    if s < S - 1:
                        assert msgs[d][lane.g_slot[d, t]] == ("grad", b, s + 1, j, r)
                    if not remat:
                        assert res[d][lane.res_r[d, t]] == ("res", b, s, j, r)
                    sent[False][d] = ("grad", b, s, j, r)
            for act, shifts, self_slot, recv in (
                (True, plan.act_shifts, rows.self_act, rows.recv_act),
                (False, plan.grad_shifts, rows.self_grad, rows.recv_grad),
            ):
                for d in range(len(workers)):
                    msgs[d][self_slot[d, t]] = sent[act][d]
                for i, (_, pairs) in enumerate(shifts):
                    for src, dst in pairs:
                        msgs[dst][recv[dst, t, i]] = sent[act][src]
        for stores, moves in ((msgs, win.msg_moves), (res, win.res_moves)):
            for d, store in enumerate(stores):
                old = list(store)
                for a, b in moves[d]:
                    if b < len(store) - 1:  # the last entry is the scratch slot
                        store[b] = old[a]
    return ran


@pytest.mark.parametrize("P,m,D", [(2, 2, 1), (3, 5, 1), (4, 4, 2), (4, 7, 1)])
@pytest.mark.parametrize("remat", [False, True], ids=["residuals", "remat"])
def test_window_plan_delivers_every_tensor(P, m, D, remat):
    """No compile: every op of 3 carrying calls and the drain reads what it needs."""
    sched = make_schedule("async-1f1b", P, m, replicas=D)
    ops = sum(op.kind is not Kind.OPT for w in sched.alive_workers for op in sched.program(w))
    assert replay(sched, remat, calls=3) == 3 * ops


@pytest.mark.slow
def test_cli_train_carries_between_steps_and_flushes_at_checkpoints(capsys, tmp_path):
    argv = ["train", "--model", "mlp", "--mesh", "1x2", "--schedule", "async-1f1b"]
    argv += ["--microbatches", "2", "--json", "--checkpoint-dir", str(tmp_path)]
    assert main([*argv, "--checkpoint-every", "2", "--steps", "3"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # a step's record comes once its batch has finished: in order, every step once
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in records)
    assert Checkpoints(tmp_path).latest_step() == 3  # saved flushed, at steps 2 and 3
