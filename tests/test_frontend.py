"""The Flax frontend: stage cutting, split/merge, stage composition, input errors."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pjit_pipe as pp
from pjit_pipe.frontend import cut_module
from pjit_pipe.frontend.cutter.balance import balance, group_costs
from pjit_pipe.models import GPT, Chain, GPTConfig, ResidualMLP, hetero_layers, mse_loss
from tests.numerics import rel_err


def compose(cut, params, x):
    act = x
    for fn, p in zip(cut.stage_fns(), cut.split(params), strict=True):
        act = fn(p, act)
    return act


class SkipAround(nn.Module):
    """a's output is read again after c: no clean cut in front of b or c, only d."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="a")(x)
        g = nn.Dense(8, name="b")(h)
        k = nn.Dense(8, name="c")(g) + h
        return nn.Dense(8, name="d")(k)


class Tied(nn.Module):
    """One Dense layer used at both ends: both stages hold it."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(6, name="shared")
        return shared(jnp.tanh(nn.Dense(6, name="middle")(shared(x))))


class Marked(nn.Module):
    """Glue-heavy model cut by explicit boundary markers only."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x = jnp.tanh(nn.Dense(8)(x * scale))
        x = pp.boundary(x)
        x = nn.Dense(8)(x) + x
        x = pp.boundary(x)
        return nn.Dense(3)(jnp.sin(x)).sum(-1, keepdims=True)


def cases():
    key = jax.random.key(1)
    xf = jax.random.normal(key, (4, 12))
    tokens = jax.random.randint(key, (4, 32), 0, 96)
    return [
        ("chain", Chain(hetero_layers()), xf),
        ("mlp", ResidualMLP(), xf),
        ("gpt", GPT(GPTConfig.tiny()), tokens),
        ("marked", Marked(), xf),
        ("skip", SkipAround(), xf),
    ]


@pytest.mark.parametrize("name,model,x", cases(), ids=[c[0] for c in cases()])
def test_split_merge_round_trip_and_composition(name, model, x):
    params = model.init(jax.random.key(0), x)
    stages = 2 if name in ("marked", "skip") else 4
    cut = cut_module(model, params, x, stages)
    parts = cut.split(params)
    owners = [k for part in parts for k in part]
    assert sorted(owners) == sorted(params["params"])  # each parameter in exactly one stage
    merged = cut.merge(parts)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(params), strict=True):
        assert a is b
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    ref = jax.jit(model.apply)(params, x)
    assert rel_err(out, ref) < 1e-5


def test_markers_are_the_only_cuts():
    x = jnp.ones((2, 5))
    model = Marked()
    params = model.init(jax.random.key(0), x)
    cut = cut_module(model, params, x, 3)
    assert [cut.events[b].kind for b in cut.bounds[1:]] == ["boundary", "boundary"]
    assert "scale" in cut.keys[0]  # the root's own parameter goes where it is read
    with pytest.raises(ValueError, match="2 clean cut points"):
        cut_module(model, params, x, 4)


def test_unclean_cut_is_dropped():
    x = jnp.ones((2, 5))
    model = SkipAround()
    params = model.init(jax.random.key(0), x)
    cut = cut_module(model, params, x, 2)
    assert cut.keys == (("a", "b", "c"), ("d",))
    with pytest.raises(ValueError, match=r"1 clean cut points \(d\)"):
        cut_module(model, params, x, 3)


def test_tied_weights_are_held_by_both_stages():
    x = jnp.ones((2, 6))
    params = Tied().init(jax.random.key(0), x)
    cut = cut_module(Tied(), params, x, 2)
    assert cut.keys == (("shared",), ("middle", "shared"))
    assert cut.shared == {"shared": (0, 1)}
    out = jax.jit(lambda p, x: compose(cut, p, x))(params, x)
    assert rel_err(out, Tied().apply(params, x)) < 1e-6


def test_balance_by_params_keeps_big_layers_apart():
    layers = [nn.Dense(64), nn.Dense(64), nn.Dense(4), nn.Dense(4)]
    x = jnp.ones((2, 64))
    model = nn.Sequential(layers)
    params = model.init(jax.random.key(0), x)
    cut = cut_module(model, params, x, 2, balance="params")
    assert cut.keys == (("layers_0",), ("layers_1", "layers_2", "layers_3"))


def test_balance_of_two_measures_is_the_best_cut_by_exhaustion():
    """With (FLOPs, parameters) per segment the cut minimises the worse of the two
    measures' largest stage over its mean stage: checked against every cut of
    random chains, and on a chain where the two measures pull apart."""
    rng = np.random.default_rng(0)

    def worst(costs, starts):  # independently: each measure's stage sums / its mean
        ends = [*starts[1:], len(costs)]
        sums = [np.sum(costs[a:b], axis=0) for a, b in zip(starts, ends, strict=True)]
        return float(np.max(np.array(sums) / (np.sum(costs, axis=0) / len(starts))))

    for _ in range(30):
        n, stages = int(rng.integers(3, 9)), int(rng.integers(2, 4))
        costs = rng.uniform(0.0, 10.0, size=(n, 2))
        cuts = [[0, *c] for c in itertools.combinations(range(1, n), stages - 1)]
        got = balance(costs.tolist(), stages)
        assert worst(costs, got) == pytest.approx(min(worst(costs, c) for c in cuts))
        assert max(group_costs(costs.tolist(), got)) == pytest.approx(worst(costs, got))
    # An embedding (parameters, no FLOPs) before four equal layers: by FLOPs alone it
    # joins a stage of two layers, by both it stays beside one
    chain = [(0.0, 6.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (1.0, 1.0)]
    assert balance([f for f, _ in chain], 2) == [0, 3]
    assert balance(chain, 2) == [0, 2]


def test_list_of_heterogeneous_layers_pipelines():
    x = jax.random.normal(jax.random.key(1), (8, 12))
    y = jax.random.normal(jax.random.key(2), (8, 8))
    pm = pp.pipeline(
        hetero_layers(),
        stages=4,
        microbatches=2,
        schedule="gpipe",
        mesh=pp.make_mesh(data=2, stage=4),
    )
    params = pm.init(jax.random.key(0), x)
    cut = pm.cut(params, x)
    shapes = [tuple(sorted(str(jax.tree.map(jnp.shape, p)).split())) for p in cut.split(params)]
    assert len(set(shapes)) == 4  # every stage holds different parameter shapes
    loss, grads = pm.value_and_grad(mse_loss)(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: mse_loss(pm.module.apply(p, x), y)))(
        params
    )
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, ref_grads) < 1e-5


def test_class_decorator():
    @pp.pipeline(stages=2, microbatches=2, schedule="1f1b")
    class TwoLayers(nn.Module):
        width: int

        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(self.width)(x))
            return nn.Dense(1)(h)

    pm = TwoLayers(width=7)
    assert isinstance(pm, pp.Pipelined)
    assert issubclass(TwoLayers.module_class, nn.Module)
    x = jnp.ones((4, 3))
    params = pm.init(jax.random.key(0), x)
    assert params["params"]["Dense_0"]["kernel"].shape == (3, 7)
    cut = pm.cut(params, x)
    assert cut.keys == (("Dense_0",), ("Dense_1",))
    assert rel_err(pm.apply(params, x), TwoLayers.module_class(7).apply(params, x)) == 0


def test_make_mesh():
    mesh = pp.make_mesh(data=2, stage=3)
    assert mesh.axis_names == ("data", "stage", "tensor") and mesh.devices.shape == (2, 3, 1)
    assert list(mesh.devices.flat) == jax.devices()[:6]
    picked = jax.devices()[4:6]
    assert list(pp.make_mesh(stage=2, devices=picked).devices.flat) == picked
    with pytest.raises(ValueError, match="16 devices needed, only 8 available"):
        pp.make_mesh(data=4, stage=4)
    with pytest.raises(ValueError, match="stage must be a positive integer"):
        pp.make_mesh(stage=0)


MLP_X = np.ones((8, 12), np.float32)


@pytest.mark.parametrize(
    "options,error",
    [
        (dict(schedule="zigzag"), "unknown schedule kind 'zigzag'"),
        (dict(schedule="interleaved-1f1b", chunks=2, microbatches=3), "multiple of stages"),
        (dict(schedule="zb-v", chunks=1), "zb-v needs chunks=2"),
        (dict(stages=3), "'stage' axis has 4 devices, but stages=3"),
        (dict(balance="even"), "balance: expected one of flops, params"),
        (dict(microbatches=0), "microbatches must be a positive integer"),
    ],
)
def test_bad_options_fail_at_construction(options, error):
    base = dict(stages=4, microbatches=4, schedule="1f1b", mesh=pp.make_mesh(data=1, stage=4))
    with pytest.raises(ValueError, match=error):
        pp.pipeline(ResidualMLP(), **{**base, **options})


def test_bad_inputs_fail_before_compiling():
    pm = pp.pipeline(hetero_layers((16, 16, 8)), stages=4, microbatches=2, schedule="1f1b")
    params = pm.init(jax.random.key(0), MLP_X)
    vg = pm.value_and_grad(mse_loss)
    with pytest.raises(ValueError, match=r"global batch 5 is not divisible by data\*microbatches"):
        vg(params, MLP_X[:5], np.ones((5, 8)))
    with pytest.raises(ValueError, match="y: batch size 4 differs"):
        vg(params, MLP_X, np.ones((4, 8)))
    with pytest.raises(ValueError, match=r"2 clean cut points .* too few for 4 stages"):
        vg(params, MLP_X, np.ones((8, 8)))
    with pytest.raises(ValueError, match="only the 'params' collection"):
        vg({**params, "batch_stats": {}}, MLP_X, np.ones((8, 8)))
    with pytest.raises(ValueError, match="needs an optax optimizer"):
        pm.train_step(mse_loss)
