"""The loss stage's forward and backward as one op (plan.FUSED).

Where a tick of the table holds a microbatch's F and whole backward on the
loss stage, the lowering runs them as one `value_and_grad`-shaped op that
stores no residual, and the lockstep price scales them by `Costs.loss_fusion`.
Checked: which entries fuse, the price in closed form, the bound below every
fused table, the plan's lanes and pools, and the compiled numbers against
jax.value_and_grad and plain optax (one and two iterations, remat too).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from test_cli import run_json
from test_lowering import (
    MB,
    assert_trees_close,
    batch,
    mesh_of,
    reference_value_and_grad,
    tiny_model,
    unpipelined_training,
    xent,
)
from test_semantics import DropoutNet, check_weighted, mean_loss, per_microbatch_reference
from test_semantics import batch as weighted_batch

import pjit_pipe as pp
from pjit_pipe.frontend.planning.measure import StageTimes
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import BW, B, F, W
from pjit_pipe.ir.ticks import PackedTicks, fused_loss_ops
from pjit_pipe.lowering import LoweringOptions, lower
from pjit_pipe.lowering.tick_plan import FUSED, build_plan
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.simulator.bounds import lockstep_lower_bound
from pjit_pipe.simulator.simulate import packed_time
from pjit_pipe.tick_packing.packer import pack_ticks

FUSING = Costs(1, 2, 1, fbw=3)  # F + BW = 4 apart, 3 as one program


def test_a_group_fuses_only_with_its_whole_backward_in_the_tick():
    last = 3
    whole = [(0, F(last, 0)), (0, BW(last, 0))]
    assert fused_loss_ops(whole, last) == frozenset(whole)
    split = [(0, F(last, 1)), (0, B(last, 1)), (0, W(last, 1))]
    assert fused_loss_ops([*split, (0, W(last, 0))], last) == frozenset(split)
    assert not fused_loss_ops(split[:2], last)  # W later: B's cotangents are stored
    assert not fused_loss_ops([(0, F(last, 0)), (1, BW(last, 0))], last)  # two iterations
    assert not fused_loss_ops([(0, F(2, 0)), (0, BW(2, 0))], last)  # not the loss stage


def test_the_price_of_a_fused_table_in_closed_form():
    """One stage, m = 3: the packer puts each microbatch's F and BW in one tick, 3 a
    tick against 4 apart; the bound counts the fused price and the table reaches it."""
    sched = make_schedule("1f1b", 1, 3)
    table = pack_ticks(sched, FUSING)
    assert len(table) == 3
    assert all(len(fused_loss_ops(es, 0)) == 2 for tick in table.ticks for es in tick.values())
    assert FUSING.loss_fusion(sched) == pytest.approx(0.75)
    assert packed_time(table, FUSING) == pytest.approx(3 * 3)
    assert packed_time(table, Costs(1, 2, 1)) == pytest.approx(3 * 4)
    assert packed_time(PackedTicks.one_op_per_tick(sched), FUSING) == pytest.approx(3 * 4)
    assert lockstep_lower_bound(sched, FUSING) == pytest.approx(3 * 3)


@pytest.mark.parametrize("kind", ["gpipe", "zb-h1", "zb-v"])
def test_without_a_fused_price_ties_go_to_the_table_that_fuses(kind):
    """Unit costs price fusion as free: of the tables at the bound, the packer keeps
    one that runs every loss-stage group as one op (one stage: all of them)."""
    chunks = 2 if kind == "zb-v" else 1
    sched = make_schedule(kind, 1, 4, chunks=chunks)
    table = pack_ticks(sched, Costs())
    assert table.fused_groups() == 4
    unpacked = PackedTicks.one_op_per_tick(sched)
    assert packed_time(table, Costs()) == pytest.approx(packed_time(unpacked, Costs()))


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1", "interleaved-1f1b", "zb-v"])
def test_the_bound_stays_below_fused_tables(kind):
    sched = make_schedule(kind, 4, 8, chunks=2 if kind in ("interleaved-1f1b", "zb-v") else 1)
    costs = Costs(5, 6, 4, 1, fbw=9)
    table = pack_ticks(sched, costs)
    table.check()
    assert lockstep_lower_bound(sched, costs) <= packed_time(table, costs) + 1e-9


def test_the_plan_runs_a_fused_group_in_the_w_lane_and_stores_nothing_for_it():
    sched = make_schedule("1f1b", 4, 4)
    table = pack_ticks(sched, FUSING)
    devices = tuple(sched.alive_workers)
    fused, plain = (build_plan(table, False, devices, fuse_loss=f) for f in (True, False))
    fid = 1 + fused.branches.index((FUSED, 3))
    where = np.argwhere(fused.rows.w.branch == fid)
    assert len(where) == 4  # every microbatch of the last stage
    for d, t in where:
        assert devices[d].stage == 3 and fused.rows.f.branch[d, t] == 0
        assert fused.rows.w.res_r[d, t] == fused.res_slots  # the scratch slot: no read
    assert (F, 3) not in {(k, s) for k, s in fused.branches}
    assert fused.res_slots <= plain.res_slots
    one_stage = make_schedule("1f1b", 1, 4)
    alone = build_plan(
        pack_ticks(one_stage, FUSING), False, (one_stage.workers[0],), fuse_loss=True
    )
    assert alone.branches == ((FUSED, 0),) and alone.res_slots == 0


@pytest.mark.parametrize(("P", "remat"), [(1, False), (4, False), (4, True)])
def test_fused_programs_give_value_and_grad(P, remat):
    sched = make_schedule("1f1b", P, 4)
    fns, params = tiny_model(P)
    x, y = batch(sched.microbatches * MB, seed=1)
    table = pack_ticks(sched, FUSING)
    step = lower(table, fns, xent, mesh_of(1, P), params, x, y, LoweringOptions(remat=remat))
    assert step._low.fused
    loss, grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = reference_value_and_grad(fns, params, x, y)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)


def train_as_optax(sched, table: PackedTicks, seed: int):
    """The program of `sched` running `table` (all its iterations in one call) on the
    tiny model gives unpipelined adam's losses and parameters; returns the step."""
    D, P, iterations = sched.replicas, sched.stages, table.iterations
    fns, params = tiny_model(P)
    opt = optax.adam(1e-2)
    batches = [batch(D * sched.microbatches * MB, seed=seed + i) for i in range(iterations)]
    xs, ys = (np.stack(b) for b in zip(*batches, strict=True))
    step = lower(table, fns, xent, mesh_of(D, P), params, *batches[0], LoweringOptions(optimizer=opt))  # fmt: skip
    got, _, losses = step.train_step(params, step.init_opt_state(params), xs, ys)
    ref, want = unpipelined_training(fns, params, opt, batches)
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-5)
    assert_trees_close(got, ref)
    return step


def test_two_fused_iterations_train_as_optax_does():
    """The first iteration's plan numbers its ops as the two-iteration plan does."""
    sched = make_schedule("1f1b", 2, 3)
    step = train_as_optax(sched, pack_ticks(sched, Costs(1, 2, 1, fbw=2.5), 2), seed=20)
    assert step._low.step_plan.branches == step._low.plan.branches
    assert (FUSED, 1) in step._low.step_plan.branches


def test_measured_fusion_scales_each_position_by_the_loss_stage_ratio():
    times = StageTimes(
        f=(1e-3, 3e-3), b=(0.0, 2e-3), w=(1e-3, 2e-3), bw=(1e-3, 3.5e-3),
        f_fused=(1e-3, 2.5e-3), c=1e-4, fbw=3e-3,
    )  # fmt: skip
    costs = times.costs(2)
    assert costs.fbw == pytest.approx([1.0, 3.0])  # (F + BW) x 3 / 6
    assert costs.loss_fusion(make_schedule("1f1b", 2, 2)) == pytest.approx(0.5)
    assert StageTimes(**{**times.__dict__, "fbw": 0.0}).costs(2).fbw is None


def test_the_cli_prices_the_fused_op_it_is_given(capsys):
    """`--fused-costs F,BW,FBW`: one stage, 4 microbatches of F + BW = 1 + 3, fused 2.5."""
    args = ("1f1b", "-P", "1", "-m", "4", "--costs", "1,2,1")
    assert run_json(capsys, *args)["lockstep_period"] == pytest.approx(4 * 4)
    fused = run_json(capsys, *args, "--fused-costs", "1,3,2.5")
    assert fused["lockstep_period"] == pytest.approx(4 * 2.5)
    assert fused["lockstep_bound"] == pytest.approx(4 * 2.5)
    assert fused["steady_period"] == pytest.approx(4 * 4)  # the event-driven IR: no fusion


def test_a_fused_weighted_loss_gives_its_ratio_and_metrics():
    """`(loss_sum, weight)` with has_aux metrics: the fused op adds its share of the
    loss vector (sum, weight and metrics) as the split F does."""
    assert check_weighted(1, "1f1b", P=2, m=4, costs=FUSING)._low.fused


def test_fused_dropout_uses_each_microbatch_keys():
    """A Flax model with dropout: the fused op draws the masks its microbatch's keys
    give, as the unpipelined step with the same per-microbatch keys does."""
    model, m = DropoutNet(), 4
    x, y = weighted_batch(m * MB, seed=4)
    params = model.init(jax.random.key(0), x)
    pm = pp.pipeline(
        model, stages=2, microbatches=m, schedule="1f1b", mesh=pp.make_mesh(data=1, stage=2),
        costs=FUSING,
    )  # fmt: skip
    key = jax.random.key(7)
    loss, grads = pm.value_and_grad(mean_loss)(params, x, y, rngs=key)
    _, step = pm.program(params, x, y, mean_loss, rngs={"dropout": key})
    assert step._low.fused
    ref_loss, ref_grads = per_microbatch_reference(model, params, x, y, key, m)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)


def test_a_rerouted_staggered_variant_fuses_and_trains_as_optax_does():
    """1F1B on 4x2 with worker (2, 1) failed: its peers run its microbatches, the
    last stage's groups fuse on whichever worker runs them, and three staggered
    iterations in one call give unpipelined adam's parameters and losses."""
    sched = schedule_with_failures("1f1b", 2, 4, 4, [(2, 1)], time_limit=1.0)
    assert sched.staggered
    table = pack_ticks(sched, FUSING, 3)
    assert table.fused_groups() > 0
    assert train_as_optax(sched, table, seed=30)._low.fused
