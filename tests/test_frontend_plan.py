"""The planner in the frontend: a Plan's layer ranges cut the model, its mapping
makes the mesh, its kind is the schedule; plan_pipeline profiles a live model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import pjit_pipe as pp
from pjit_pipe.errors import MeshError, OptionError
from pjit_pipe.frontend import cut_module
from pjit_pipe.frontend.cutter.cut import layer_cut
from pjit_pipe.frontend.planning.live_plan import profile_model, scaled
from pjit_pipe.models import GPT, GPTConfig, lm_loss
from pjit_pipe.planner import CostModel, Plan, plan_model
from tests.numerics import rel_err
from tests.test_frontend import compose


def tower():
    return nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(8), nn.Dense(8), nn.Dense(2)])


def test_make_mesh_from_a_mapping():
    devices = jax.devices()
    mesh = pp.make_mesh(mapping=[[3, 1], [0, 2]])
    assert dict(mesh.shape) == {"data": 2, "stage": 2, "tensor": 1}
    assert mesh.devices[..., 0].tolist() == [[devices[3], devices[1]], [devices[0], devices[2]]]
    assert pp.make_mesh(data=1, stage=2, mapping=[[5, 4]]).devices[..., 0].tolist() == [
        devices[5:3:-1]
    ]
    with pytest.raises(ValueError, match="a device used twice"):
        pp.make_mesh(mapping=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"out of range: \[8\]"):
        pp.make_mesh(mapping=[[0, 8]])
    with pytest.raises(ValueError, match="D rows of P device indices"):
        pp.make_mesh(mapping=[[0, 1], [2]])
    with pytest.raises(ValueError, match="stage=3 but the mapping has 2"):
        pp.make_mesh(stage=3, mapping=[[0, 1]])


def test_cut_takes_layer_ranges():
    model, x = tower(), jnp.ones((2, 3))
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    assert layer_cut(model, params, x).stages == 4  # the tanh is glue: 4 clean layers
    cut = cut_module(model, params, x, 2, layers=((0, 2), (3, 3)))
    assert cut.keys == (("layers_0", "layers_2", "layers_3"), ("layers_4",))
    with pytest.raises(ValueError, match=r"range \(2, 3\) should start at layer 1"):
        cut_module(model, params, x, 2, layers=((0, 0), (2, 3)))
    with pytest.raises(ValueError, match="the model has 4 layers"):
        cut_module(model, params, x, 2, layers=((0, 0), (1, 2)))


PLAN = Plan(stages=((0, 0), (1, 3)), mapping=((5, 2),), schedule="zb-h1")


def test_a_plan_sets_cut_mesh_and_schedule():
    model, plan, x = tower(), PLAN, jnp.ones((8, 3))
    pm = pp.pipeline(model, microbatches=4, plan=plan)
    assert pm.mesh.devices[..., 0].tolist() == [[jax.devices()[5], jax.devices()[2]]]
    assert pm.schedule.kind == "zb-h1"
    params = jax.eval_shape(pm.init, jax.random.key(0), x)
    assert pm.cut(params, x).keys == (("layers_0",), ("layers_2", "layers_3", "layers_4"))
    with pytest.raises(OptionError, match="stages: 3 differs from the plan's 2"):
        pp.pipeline(model, stages=3, microbatches=4, plan=plan)
    with pytest.raises(MeshError, match="differs from the plan's 1 x 2"):
        pp.pipeline(model, microbatches=4, plan=plan, mesh=pp.make_mesh(data=2, stage=2))
    with pytest.raises(OptionError, match="stages: required"):
        pp.pipeline(model, microbatches=4)


@pytest.mark.slow
def test_plan_pipeline_profiles_the_layers_and_plans_them():
    model, x = tower(), jax.random.normal(jax.random.key(1), (2, 3))
    params = jax.jit(model.init)(jax.random.key(0), x)
    profile = profile_model(model, params, x)
    assert len(profile) == 4 and profile.names[:2] == ("layers_0", "layers_2")
    assert (profile.f > 0).all() and (profile.b >= 0).all()
    assert profile.param_bytes.tolist() == [4.0 * (3 * 8 + 8), 4.0 * 72, 4.0 * 72, 4.0 * 18]
    assert profile.cut_bytes().tolist() == [4.0 * 2 * 8] * 3  # one (2, 8) float32 per cut
    plan = pp.plan_pipeline(model, params, x, microbatches=4, stages=2, replicas=2)
    assert plan.num_stages == 2 and plan.replicas == 2
    assert plan.stages[0][0] == 0 and plan.stages[-1][1] == 3
    pm = pp.pipeline(model, microbatches=4, plan=plan)
    cut = pm.cut(params, jnp.ones((16, 3)))
    assert rel_err(compose(cut, params, x), model.apply(params, x)) < 1e-6


@pytest.mark.slow
def test_auto_plan_on_the_tiny_gpt_matches_jax():
    """plan="auto" on the 8 CPU devices: profile, probe and plan at the first step,
    one pipeline compile, gradients equal to jax.value_and_grad."""
    model = GPT(GPTConfig.tiny())
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 96)
    x, y = tokens[:, :-1], tokens[:, 1:]
    pm = pp.pipeline(model, microbatches=2, plan="auto")
    assert pm.plan is None
    with pytest.raises(AttributeError, match="made at first use"):
        pm.mesh  # noqa: B018
    params = jax.jit(pm.init)(jax.random.key(0), x)
    loss, grads = pm.value_and_grad(lm_loss)(params, x, y)
    ref = jax.jit(jax.value_and_grad(lambda p: lm_loss(model.apply(p, x), y)))
    ref_loss, ref_grads = ref(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-4
    # the plan is the planner's for the same profile, devices and replica count
    auto, plan = pm.auto_plan, pm.plan
    assert len(auto.profile) == 7 and auto.rows == 8  # 16 rows / (D=1 x 2 microbatches)
    # the 4 identical blocks are timed once (one compile), so their times are equal
    assert auto.profile.names[1:5] == tuple(f"blocks_{k}" for k in range(4))
    assert len(set(auto.profile.f[1:5].tolist())) == 1
    assert set(auto.periods) == {1, 2, 4, 8}  # every D that divides the batch
    profile = scaled(auto.profile, 1 / plan.replicas)
    expected = plan_model(CostModel(profile, auto.devices, 2), replicas=plan.replicas)
    assert expected.plan == plan and expected.period == min(p for p in auto.periods.values() if p)
    # ... and it is what runs: its cut, mesh and kind
    assert pm.schedule.kind == plan.schedule
    assert pm.mesh.devices.tolist() == pp.make_mesh(mapping=plan.mapping).devices.tolist()
    assert len(pm.cut(params, x).keys) == plan.num_stages
    assert pm.describe(params, x).startswith(f"plan='auto': {plan.replicas} x {plan.num_stages}")


def test_auto_plan_refuses_options_it_cannot_honour():
    model = tower()
    with pytest.raises(OptionError, match=r"schedule: plan='auto' .* 'zb-v' is not one"):
        pp.pipeline(model, microbatches=4, plan="auto", schedule="zb-v")
    with pytest.raises(MeshError, match="stages: 3 differs from the mesh's stage axis"):
        pp.pipeline(model, microbatches=4, plan="auto", stages=3, mesh=pp.make_mesh(stage=2))
    with pytest.raises(MeshError, match="mesh: expected a"):
        pp.pipeline(model, microbatches=4, plan="auto", mesh=jax.devices())
    with pytest.raises(OptionError, match="failed: plan='auto' chooses the mesh"):
        pp.pipeline(model, microbatches=4, plan="auto", failed=[(0, 1)])
    with pytest.raises(OptionError, match="stages: 9 stages need more than the 8 devices"):
        pp.pipeline(model, microbatches=4, plan="auto", stages=9)
    with pytest.raises(OptionError, match="plan: expected 'auto'"):
        pp.pipeline(model, microbatches=4, plan="fast")
    with pytest.raises(OptionError, match="remat: expected True, False or 'auto'"):
        pp.pipeline(model, microbatches=4, plan="auto", remat="yes")
    # as a class decorator, each instance is planned at its own first use
    Tower = pp.pipeline(microbatches=4, plan="auto")(nn.Sequential)
    assert Tower([nn.Dense(2)]).plan is None
    # a given Plan with a mesh on other devices than its mapping's
    with pytest.raises(MeshError, match="differ from the plan's mapping"):
        pp.pipeline(model, microbatches=4, plan=PLAN, mesh=pp.make_mesh(data=1, stage=2))


def test_auto_plan_on_a_given_mesh_keeps_to_its_devices_and_shape():
    """mesh= with plan="auto": its 2 devices are planned over (probed as the pool)
    and its 1 x 2 shape is fixed; the plan's mapping indexes jax.devices()."""
    model, x = tower(), jax.random.normal(jax.random.key(1), (8, 3))
    devices = jax.devices()
    mesh = pp.make_mesh(data=1, stage=2, devices=[devices[6], devices[3]])
    pm = pp.pipeline(model, microbatches=4, plan="auto", mesh=mesh)
    params = jax.jit(model.init)(jax.random.key(0), x)
    planned = pm.plan_for(params, x)  # plans without compiling a pipeline
    assert pm.auto_plan.pool == (devices[6], devices[3])
    assert pm.auto_plan.periods.keys() == {1} and pm.auto_plan.rows == 2
    assert pm.plan.replicas == 1 and pm.plan.num_stages == 2
    assert sorted(pm.plan.mapping[0]) == [3, 6]
    assert set(planned.mesh.devices.flat) == {devices[3], devices[6]}
