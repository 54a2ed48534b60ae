"""costs="measure": stage costs timed from the model, cached, and used by the schedule search."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjit_pipe as pp
import pjit_pipe.frontend.planning.measure as measure_module
from pjit_pipe.cli.train import show_costs
from pjit_pipe.ir.costs import Costs
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator.simulate import packed_time


class LightThenHeavy(nn.Module):
    """One small dense layer, a boundary, then three wide ones: stage 1 does the work."""

    @nn.compact
    def __call__(self, x):
        x = pp.boundary(jnp.tanh(nn.Dense(16)(x)))
        for _ in range(3):
            x = jnp.tanh(nn.Dense(512)(x))
        return nn.Dense(4)(x)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def auto_pipeline(stages: int, m: int, rows: int):
    """(LightThenHeavy pipelined under "auto" on a 1 x stages mesh, x, y) with
    `rows` rows per microbatch."""
    x = jax.random.normal(jax.random.key(0), (m * rows, 8))
    y = jax.random.normal(jax.random.key(1), (m * rows, 4))
    mesh = pp.make_mesh(1, stages)
    pm = pp.pipeline(LightThenHeavy(), stages=stages, microbatches=m, schedule="auto", mesh=mesh)
    return pm, x, y


@pytest.mark.slow  # compiles F, B, W, BW of each stage and the pipeline
def test_measured_costs_are_positive_cached_and_steer_auto(capsys, monkeypatch):
    m = 4
    pm, x, y = auto_pipeline(2, m, 32)
    model = pm.module
    assert pm.measure  # the default for auto
    params = pm.init(jax.random.key(2), x)
    loss, grads = pm.value_and_grad(mse)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: mse(model.apply(p, x), y)))(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    costs = pm.costs
    assert all(v > 0 for v in (*costs.f, *costs.w, costs.b[1], costs.c, costs.tick))
    assert costs.b[0] == 0  # the first stage's B is empty
    assert costs.f[1] > costs.f[0]  # the heavy stage is measured as heavier

    def timed_again(*args, **kwargs):
        raise AssertionError("cached costs were measured again")

    monkeypatch.setattr(measure_module, "median_seconds", timed_again)
    monkeypatch.setattr(measure_module, "sample_seconds", timed_again)
    again = pm.with_options().measure_costs(params, x, y, mse)  # a new pipeline, same model
    monkeypatch.undo()
    assert again == costs and again.tick == costs.tick  # the tick's cost is cached too

    # The search sees them: the compiled schedule is auto's for these costs, and
    # the same search with the stage costs swapped chooses differently.
    assert pm.schedule.programs == make_schedule("auto", 2, m, costs=costs).programs
    swapped = Costs(f=costs.f[::-1], b=costs.b[::-1], w=costs.w[::-1], c=costs.c)
    assert make_schedule("auto", 2, m, costs=swapped).programs != pm.schedule.programs

    # `pjit-pipe train --show-costs` prices a step under them: the compiled table is
    # at or above the bound no tick table beats.
    show_costs(pm, True)
    step = json.loads(capsys.readouterr().out)["step"]
    assert step["ticks_ms"] == pytest.approx(packed_time(pm.tick_table(), costs))
    assert 0 < step["bound_ms"] <= step["ticks_ms"] + 1e-9 and step["event_ms"] > 0


def test_a_single_stage_is_measured_without_a_boundary():
    """One stage sends no message: no transfer cost, and an idle tick still costs time."""
    pm, x, y = auto_pipeline(1, 2, 4)
    costs = pm.measure_costs(pm.init(jax.random.key(2), x), x, y, mse)
    assert costs.c == 0 and costs.tick > 0
    assert costs.f[0] > 0 and costs.w[0] > 0


def test_balance_by_measured_time_cuts_the_model():
    from pjit_pipe.frontend.cutter.cut import cut_module
    from pjit_pipe.models.mlp import Chain, Dense

    # The wide layers cost about a thousand times the light ones, so load on the
    # machine cannot reorder them.
    model = Chain([Dense(8), Dense(8), Dense(4096), Dense(8)])
    x = jnp.ones((256, 8))
    params = model.init(jax.random.key(0), x)
    cut = cut_module(model, params, x, 2, balance="time")
    assert cut.stages == 2
    assert sorted(k for keys in cut.keys for k in keys) == sorted(cut.units)
    # The two wide layers (8 -> 4096, 4096 -> 8) take most of the time: the two
    # light ones stay together in the first stage.
    assert cut.bounds[1] >= 2


def test_show_costs_args_parse_back_into_the_same_costs():
    """`--show-costs`'s CLI texts, read by `pjit-pipe schedule`, give the per-stage
    means of the measured costs (ms), the fused ones included."""
    from pjit_pipe.cli.schedule_command import costs_arg, fused_costs_arg
    from pjit_pipe.frontend.planning.measure import StageTimes

    times = StageTimes(
        f=(1e-3, 3e-3), b=(0.0, 2e-3), w=(1e-3, 2e-3), bw=(1e-3, 3.5e-3),
        f_fused=(1e-3, 2.5e-3), c=1e-4, tick=2e-4,
    )  # fmt: skip
    table = times.as_dict(2)
    split = costs_arg(table["costs_arg"])
    assert (split.f, split.b, split.w, split.c) == pytest.approx((2.0, 1.0, 1.5, 0.1))
    assert fused_costs_arg(table["fused_costs_arg"]) == pytest.approx((1.75, 2.25))
    # The loss stage's F and BW as one program at half their price: each position's
    # F + BW halved (1, 3), their mean the third number.
    table = dataclasses.replace(times, fbw=3e-3).as_dict(2)
    assert fused_costs_arg(table["fused_costs_arg"]) == pytest.approx((1.75, 2.25, 2.0))


def test_a_v_layout_sums_each_position_s_own_chunks():
    """zb-v puts virtual stages p and 2P-1-p on position p (the first and the last,
    with the loss, together): measured costs sum those, not p and p + P."""
    from pjit_pipe.frontend.planning.measure import StageTimes
    from pjit_pipe.ir.schedule import v_layout

    ms = (1e-3, 2e-3, 3e-3, 4e-3)  # four virtual stages, one time each
    times = StageTimes(f=ms, b=ms, w=ms, bw=ms, f_fused=ms, c=0.0)
    assert times.costs(2, v_layout(2)).f == pytest.approx([1.0 + 4.0, 2.0 + 3.0])
    assert times.costs(2).f == pytest.approx([1.0 + 3.0, 2.0 + 4.0])  # interleaved
    assert times.as_dict(2, v_layout(2))["f"] == pytest.approx([5.0, 5.0])
