"""Flax NNX models pipeline like linen ones: cuts at children, exact gradients, adam steps."""

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import pjit_pipe as pp
from pjit_pipe.frontend import cut_module

WIDTHS = (6, 10, 7, 12, 5)  # a different width per layer: stages differ in shapes


class Tower(nnx.Module):
    """An embedding, a list of heterogeneous blocks, a head; one root parameter."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(3, WIDTHS[0], rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(WIDTHS)])
        self.head = nnx.Linear(WIDTHS[-1], 2, rngs=rngs)
        self.scale = nnx.Param(jnp.full((WIDTHS[-1],), 1.5))

    def __call__(self, x):
        h = jnp.tanh(self.embed(x))
        for block in self.blocks:
            h = jnp.tanh(block(h))
        return self.head(h * self.scale)


class Marked(nnx.Module):
    """Cut only at boundary markers, which sit in the root's own __call__."""

    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 8, rngs=rngs)
        self.c = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        h = pp.boundary(jnp.tanh(self.a(x)))
        h = jnp.tanh(self.b(h)) + h
        return self.c(h)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def batch(n: int = 32, seed: int = 0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 3)), jax.random.normal(ky, (n, 2))


def reference_value_and_grad(model: nnx.Module, x, y):
    """Unpipelined loss and gradients, by NNX's own autodiff on the module."""
    loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
    return loss, nnx.to_pure_dict(grads)


def assert_close(a, b, rtol=1e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = float(jnp.max(jnp.abs(v))) + 1e-30
        assert float(jnp.max(jnp.abs(u - v))) / scale <= rtol


def test_cut_owns_whole_children_and_round_trips():
    model = Tower(nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    x, _ = batch(4)
    cut = cut_module(model, params, x, 4)
    owned = sorted(k for keys in cut.keys for k in keys)
    assert owned == sorted(
        ["embed", "blocks/0", "blocks/1", "blocks/2", "blocks/3", "head", "scale"]
    )
    assert "scale" in cut.keys[-1]  # the root's own parameter goes where it is read
    assert_close(cut.merge(cut.split(params)), params, rtol=0)
    act = x
    for fn, p in zip(cut.stage_fns(), cut.split(params), strict=True):
        act = fn(p, act)
    assert_close(act, model(x))


def test_value_and_grad_matches_nnx():
    model = Tower(nnx.Rngs(1))
    pm = pp.pipeline(model, stages=4, microbatches=4, schedule="zb-h1", mesh=pp.make_mesh(1, 4))
    params = pm.init(None, None)
    x, y = batch()
    loss, grads = pm.value_and_grad(mse)(params, x, y)
    ref_loss, ref_grads = reference_value_and_grad(model, x, y)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    # An nnx.State is accepted as well as its pure dict.
    loss_s, _ = pm.value_and_grad(mse)(nnx.state(model, nnx.Param), x, y)
    assert_close(loss_s, ref_loss)


def test_adam_steps_match_unpipelined():
    model = Tower(nnx.Rngs(2))
    opt = optax.adam(1e-2)
    pm = pp.pipeline(
        model, stages=2, microbatches=2, schedule="1f1b", mesh=pp.make_mesh(2, 2), optimizer=opt
    )
    x, y = batch()
    step = pm.train_step(mse)
    state = step.init(pm.init(None, None), (x, y))
    ref = nnx.Optimizer(model, opt, wrt=nnx.Param)
    for _ in range(3):
        state, loss = step(state, (x, y))
        ref_loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
        ref.update(model, grads)
        assert_close(loss, ref_loss)
    assert_close(state.params, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_sequential_from_a_list_and_markers():
    layers = [nnx.Linear(3, 5, rngs=nnx.Rngs(0)), nnx.Linear(5, 4, rngs=nnx.Rngs(1))]
    pm = pp.pipeline(layers, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2))
    x, _ = batch(4)
    params = pm.init(None, x)
    assert_close(pm.apply(params, x), layers[1](layers[0](x)))
    cut = cut_module(pm.model, params, x, 2)
    assert cut.keys == (("layers/0",), ("layers/1",))

    marked = Marked(nnx.Rngs(3))
    xm = jnp.ones((2, 4))
    cut = cut_module(marked, nnx.to_pure_dict(nnx.state(marked, nnx.Param)), xm, 2)
    assert [cut.events[b].kind for b in cut.bounds[1:]] == ["boundary"]
    assert cut.keys == (("a",), ("b", "c"))

    # As a class decorator: instances are pipelined, the class stays plain NNX.
    decorated = pp.pipeline(stages=2, microbatches=2, mesh=pp.make_mesh(1, 2))(Marked)
    pm = decorated(nnx.Rngs(3))
    assert isinstance(pm, pp.Pipelined) and decorated.module_class is Marked
    assert_close(pm.apply(pm.init(None, None), xm), marked(xm))


def test_non_param_state_is_refused():
    class WithStats(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.norm = nnx.BatchNorm(3, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.lin(x))

    with pytest.raises(ValueError, match=r"only nnx\.Param state"):
        pp.pipeline(WithStats(nnx.Rngs(0)), stages=2, microbatches=2, mesh=pp.make_mesh(1, 2))
    with pytest.raises(TypeError, match=r"flax\.linen\.Module or flax\.nnx\.Module"):
        pp.pipeline(object(), stages=2, microbatches=2)


class NNXScanStack(nnx.Module):
    """Four blocks made by nnx.vmap (one stacked module), run by nnx.scan."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(3, 8, rngs=rngs)

        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(8, 8, rngs=rngs)

        self.layers = create(rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return h + jnp.tanh(layer(h))

        return self.out(body(self.inp(x), self.layers))


def test_nnx_scan_stack_is_refused_by_name():
    model = NNXScanStack(nnx.Rngs(0))
    pm = pp.pipeline(model, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2))
    with pytest.raises(ValueError, match=r"nnx.scan stack cannot be cut: keep the layers in"):
        pm.cut(pm.init(None, None), jnp.ones((4, 3)))


class DropBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, shared: bool = False):
        self.lin = nnx.Linear(8, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.rngs = rngs if shared else None  # shared: draws from the caller's own Rngs

    def __call__(self, h):
        h = h + self.drop(jnp.tanh(self.lin(h)))
        if self.rngs is not None:
            h = h * jax.random.bernoulli(self.rngs.dropout(), 0.9, h.shape)
        return h


class DropoutTower(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, shared: bool = False):
        self.inp = nnx.Linear(3, 8, rngs=rngs)
        self.blocks = nnx.List([DropBlock(rngs, shared) for _ in range(3)])
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def test_nnx_dropout_without_keys_is_refused_naming_the_stream():
    model = DropoutTower(nnx.Rngs(params=0, dropout=1))
    pm = pp.pipeline(model, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2))
    with pytest.raises(ValueError, match=r"streams \['dropout'\].*rngs=\{'dropout': key\}"):
        pm.cut(pm.init(None, None), jnp.ones((4, 3)))


@pytest.mark.slow
def test_nnx_dropout_uses_reseeded_streams_per_microbatch():
    """Microbatch i runs like the module after nnx.reseed(dropout=fold_in(key, i))."""
    model = DropoutTower(nnx.Rngs(params=0, dropout=1))
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    pm = pp.pipeline(model, stages=2, microbatches=2, schedule="1f1b", mesh=pp.make_mesh(2, 2))
    params = pm.init(None, None)
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    key = jax.random.key(7)
    loss, grads = pm.value_and_grad(mse)(params, x, y, rngs=key)

    graphdef, _, streams = nnx.split(model, nnx.Param, ...)

    def reference(p):
        losses = []
        for i in range(4):  # replica r's microbatch j is microbatch 2r + j: rows 2i, 2i+1
            state = jax.tree.map(lambda a: a, nnx.state(model, nnx.Param))
            nnx.replace_by_pure_dict(state, p)
            m = nnx.merge(graphdef, state, jax.tree.map(lambda a: a, streams))
            nnx.reseed(m, dropout=jax.random.fold_in(key, i))
            losses.append(mse(m(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
        return jnp.mean(jnp.stack(losses))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))
    other, _ = pm.value_and_grad(mse)(params, x, y, rngs=jax.random.key(8))
    assert abs(float(other) - float(loss)) > 1e-4  # the masks depend on the key


def test_nnx_stream_shared_by_two_layers_is_refused():
    with pytest.raises(ValueError, match=r"blocks/0 and blocks/1 draw from the same nnx.Rngs"):
        pp.pipeline(DropoutTower(nnx.Rngs(0), shared=True), stages=2, microbatches=2)
