"""No zero-size operand reaches a shard_map (jax 0.11's compiler crashes on one):
zero-size arguments and the zero-size index constant of a whole-axis scatter
(`a.at[:].add(b)`) are made inside, with the plain results (closed forms and
nnx.value_and_grad)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

import pjit_pipe as pp
from pjit_pipe.lowering import shard_map_without_empty_operands
from tests.numerics import rel_err


def test_whole_axis_scatters_and_zero_size_arguments_compile_and_match():
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices()[:4])
    workers = ("a", "b")

    def body(x, empty_rows, empty):
        x = x.at[:].add(1.0 + lax.axis_index(workers))  # a zero-size index constant
        x = lax.scan(lambda c, _: (c.at[:, 0:4].add(1.0), None), x, None, length=2)[0]
        return lax.psum(x, workers) + empty["ids"].sum(), empty_rows * 2

    f = jax.jit(
        shard_map_without_empty_operands(
            body,
            mesh=mesh,
            in_specs=(PS(workers), PS(workers), PS()),
            out_specs=(PS(workers), PS(workers)),
            check_vma=False,
        )
    )
    x = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    placed = jax.device_put(x, NamedSharding(mesh, PS(workers)))
    out, rows = f(placed, jnp.zeros((4, 0)), {"ids": jnp.zeros((0,), jnp.int32)})
    # device d holds row d; each adds 1 + d, then 2; the psum adds the four rows
    expected = np.tile((x + 3.0).sum(0) + np.arange(4.0).sum(), (4, 1))
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert rows.shape == (4, 0)


class WholeAxisScatterBlock(nnx.Module):
    """A residual block written as a scatter over the whole batch axis."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, h):
        return h.at[:].add(jnp.tanh(self.lin(h)))


class WholeAxisScatterMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([WholeAxisScatterBlock(rngs) for _ in range(2)])

    def __call__(self, h):
        for block in self.blocks:
            h = block(h)
        return h


@pytest.mark.slow
def test_a_model_with_whole_axis_scatters_matches_jax():
    model = WholeAxisScatterMLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 4))
    y = jax.random.normal(jax.random.key(2), (4, 4))

    def mse(out, y):
        return jnp.mean((out - y) ** 2)

    pm = pp.pipeline(model, stages=2, microbatches=2, mesh=pp.make_mesh(data=1, stage=2))
    loss, grads = pm.value_and_grad(mse)(pm.init(None, None), x, y)
    ref_loss, ref_grads = nnx.value_and_grad(lambda m: mse(m(x), y))(model)
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(grads, nnx.to_pure_dict(ref_grads)) < 1e-5
