"""One compile path (pjit_pipe.compiler): every caller builds its schedule through
`build_schedule`, once per pipeline, with its costs resolved once."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import pjit_pipe as pp
import pjit_pipe.compiler.build as build
from pjit_pipe.cli import main
from pjit_pipe.compiler import ScheduleSpec, build_schedule, build_table
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.serialize import to_json
from pjit_pipe.schedules import make_schedule
from pjit_pipe.tick_packing import pack_ticks


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = pp.boundary(jnp.tanh(nn.Dense(8)(x)))
        return nn.Dense(4)(x)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The kinds of every schedule the compile path makes from here on."""
    made: list[str] = []

    def counting(kind, *args, **kwargs):
        made.append(kind)
        return make_schedule(kind, *args, **kwargs)

    monkeypatch.setattr(build, "make_schedule", counting)
    return made


def test_a_pipeline_builds_its_schedule_once(builds) -> None:
    x = jax.random.normal(jax.random.key(0), (8, 6))
    y = jax.random.normal(jax.random.key(1), (8, 4))
    pm = pp.pipeline(
        TwoDense(), stages=2, microbatches=4, schedule="zb-h1", mesh=pp.make_mesh(1, 2)
    )
    params = pm.init(jax.random.key(2), x)
    loss, _ = pm.value_and_grad(mse)(params, x, y)
    pm.value_and_grad(mse)(params, x, y)
    assert (
        pm.tick_table().schedule == pm.schedule
    )  # packed from it (the pack cache may hold an equal one)
    assert builds == ["zb-h1"]
    ref = mse(TwoDense().apply(params, x), y)
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref))


@pytest.mark.slow  # times each stage's F, B, W and BW before the first compile
def test_measured_costs_are_resolved_before_the_one_build(builds) -> None:
    x = jax.random.normal(jax.random.key(0), (8, 6))
    y = jax.random.normal(jax.random.key(1), (8, 4))
    pm = pp.pipeline(TwoDense(), stages=2, microbatches=4, schedule="auto", mesh=pp.make_mesh(1, 2))
    params = pm.init(jax.random.key(2), x)
    with pytest.raises(pp.OptionError, match="measure_schedule"):
        pm.schedule  # noqa: B018  (costs not measured yet: nothing to build under)
    pm.value_and_grad(mse)(params, x, y)
    assert builds == ["auto"]
    assert isinstance(pm.costs, Costs) and pm.schedule.kind.startswith("auto")


def test_the_schedule_command_builds_once(builds, capsys) -> None:
    argv = ["schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--json"]
    assert main([*argv, "--costs", "1,2,1,0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert builds == ["zb-h1"]
    # The same chain, called directly, gives the same schedule and lockstep table.
    costs = Costs(1, 2, 1, 0)
    schedule = build_schedule(ScheduleSpec("zb-h1", 4, 8), costs)
    assert out["schedule"] == to_json(schedule)
    assert build_table(schedule, costs).ticks == pack_ticks(schedule, costs).ticks


def test_the_planner_prices_schedules_of_the_same_chain(builds) -> None:
    from pjit_pipe.planner.cost import schedule_of

    schedule_of.cache_clear()
    assert schedule_of("1f1b", 3, 6, 2).programs == make_schedule("1f1b", 3, 6, replicas=2).programs
    assert builds == ["1f1b"]


def test_a_bad_chunk_count_names_the_option() -> None:
    with pytest.raises(pp.ScheduleError, match=r"zb-v needs chunks=2 \(got chunks=3\)"):
        build_schedule(ScheduleSpec("zb-v", 4, 8, chunks=3))
