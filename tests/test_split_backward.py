"""The split backward (pjit_pipe/lowering/compute/stage_backward.py): W's structure and its numbers.

W must hold one contraction per weight matmul of the stage (no input-gradient
chain), B must store parameter-sized cotangents for elementwise sites (biases,
norm scales), and B then W must give jax.value_and_grad's numbers for
parameters read twice in a stage and for an embedding lookup in a middle stage.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.lowering import lower
from pjit_pipe.lowering.compute.flat_jaxpr import count_primitives
from pjit_pipe.lowering.compute.loss import LossLayout
from pjit_pipe.lowering.compute.stage_backward import SplitBackward, _dot_weight_grad
from pjit_pipe.lowering.compute.stages import StageVjp
from pjit_pipe.lowering.tick_plan import build_plan
from pjit_pipe.models.gpt import Block
from pjit_pipe.schedules import make_schedule
from tests.test_lowering import assert_trees_close, mesh_of


def test_w_holds_one_contraction_per_weight_matmul():
    block = Block(d_model=16, n_heads=2, d_ff=32)  # qkv, proj, two MLP denses
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    params = block.init(jax.random.key(1), x)
    fns = [lambda p, a: a * p, lambda p, a: block.apply(p, a), lambda p, a: a * p]
    stage_params = [jnp.ones(()), params, jnp.ones(())]
    aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
    loss = LossLayout(lambda out, y: jnp.mean(out**2)).vector  # the lowering's last-stage form
    split = StageVjp(fns, loss, stage_params, aval, aval, split=(1,))
    fused = StageVjp(fns, loss, stage_params, aval, aval)
    res = split.zero_residuals()
    w = jax.make_jaxpr(lambda p, r: split.weight_grad(1, p, r))(params, res)
    forward = jax.make_jaxpr(lambda p, a: block.apply(p, a))(params, x)
    einsums = 2  # attention's q.k and p.v: no weight, no contraction in W
    weight_matmuls = count_primitives(forward.jaxpr, "dot_general") - einsums
    assert weight_matmuls == 4
    assert count_primitives(w.jaxpr, "dot_general") == weight_matmuls
    # Each kernel gradient comes out in the kernel's own layout: no transpose after
    # the contraction (XLA turned that one into a copy of the stored cotangent).
    assert count_primitives(w.jaxpr, "transpose") == 0
    # The old W re-ran the whole pullback: every input-gradient contraction too.
    old = fused.zero_residuals()
    g = jnp.ones(x.shape)
    old_w = jax.make_jaxpr(lambda p, r: fused.pullback(1, p, r)(g)[0])(params, old)
    assert count_primitives(old_w.jaxpr, "dot_general") > 2 * weight_matmuls


@pytest.mark.parametrize(
    ("lhs", "rhs", "dims"),
    [
        ((4, 6, 8), (8, 5), (((2,), (0,)), ((), ()))),  # a Dense kernel
        ((8, 5), (4, 6, 8), (((0,), (2,)), ((), ()))),  # the weight on the left
        ((3, 4, 6, 7), (3, 7, 2), (((3,), (1,)), ((0,), (0,)))),  # batched
        ((3, 6, 5, 7), (3, 7, 5, 2), (((3, 2), (1, 2)), ((0,), (0,)))),  # two contractions
        ((6, 5), (2, 5, 6), (((1, 0), (1, 2)), ((), ()))),  # contracted in another order
    ],
)
@pytest.mark.parametrize("param_side", [0, 1])
def test_weight_grad_of_a_contraction_matches_jax_vjp(lhs, rhs, dims, param_side):
    keys = jax.random.split(jax.random.key(0), 3)
    a, b = jax.random.normal(keys[0], lhs), jax.random.normal(keys[1], rhs)

    def contract(a, b):
        return jax.lax.dot_general(a, b, dims)

    (eqn,) = jax.make_jaxpr(contract)(a, b).jaxpr.eqns
    ct = jax.random.normal(keys[2], contract(a, b).shape)
    expected = jax.vjp(contract, a, b)[1](ct)[param_side]
    got = _dot_weight_grad(eqn, (b, a)[param_side], ct, param_side)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def tied_stage(p, a):
    """A weight read twice (w and w.T), a bias, and an embedding lookup whose
    indices come from the activation."""
    rows = (a[:, 0] > 0).astype(jnp.int32)
    h = jnp.tanh(a @ p["w"] + p["b"] + p["table"][rows])
    return jnp.tanh(h @ p["w"].T) * p["w"][0]


def test_tied_parameters_and_lookup_match_value_and_grad():
    d, m = 6, 4
    keys = jax.random.split(jax.random.key(0), 6)
    params = [
        {"w0": jax.random.normal(keys[0], (5, d))},
        {
            "w": jax.random.normal(keys[1], (d, d)) / np.sqrt(d),
            "b": 0.1 * jax.random.normal(keys[2], (d,)),
            "table": jax.random.normal(keys[3], (2, d)),
        },
    ]
    fns = [lambda p, a: jnp.tanh(a @ p["w0"]), tied_stage]
    x = jax.random.normal(keys[4], (m * 3, 5))
    y = jax.random.normal(keys[5], (m * 3, d))

    def mse(out, y):
        return jnp.mean((out - y) ** 2)

    def reference(params, x, y):
        return mse(fns[1](params[1], fns[0](params[0], x)), y)

    step = lower(make_schedule("zb-h1", 2, m), fns, mse, mesh_of(1, 2), params, x, y)
    assert step._low.st.split == {1}
    loss, grads = step.value_and_grad(params, x, y)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(params, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(grads, ref_grads)


def test_direct_parameter_output_gets_its_gradient():
    """A stage output that depends on parameters alone still gets its gradient."""
    fn = lambda p, a, y: (a * p["s"], p["s"] * 2.0)  # noqa: E731
    p, a = {"s": jnp.arange(3.0)}, jnp.ones(3)
    sb = SplitBackward(fn, p, a, None)
    _, pull, stored = jax.vjp(
        lambda a, eps: sb.forward(p, a, None, eps), a, sb.zero_perturbations(), has_aux=True
    )
    g = (jnp.full(3, 2.0), jnp.full(3, 3.0))
    _, cots = pull(g)
    got = sb.weight_grads(p, stored, cots)
    want = jax.vjp(lambda p: fn(p, a, None), p)[1](g)[0]
    np.testing.assert_allclose(got["s"], want["s"])


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_b_pool_row_lives_from_f_to_b_and_w_pool_row_to_w(kind):
    """The tick plan (no compile): a split stage's B reads the B-pool slot its F
    wrote and frees it there, W reads the W-pool slot (B wrote its cotangents
    there); the first stage's W reads its F's W-pool slot; no slot is written
    while a microbatch still needs it."""
    P, m = 4, 8
    sched = make_schedule(kind, P, m)
    table = PackedTicks.one_op_per_tick(sched)
    plan = build_plan(table, False, sched.alive_workers, split=range(1, P))
    lanes = (plan.rows.f, plan.rows.b, plan.rows.w)
    kinds = {i + 1: k for i, k in enumerate(plan.branches)}
    for d in range(len(sched.alive_workers)):
        live = {"b": {}, "w": {}}  # pool -> slot -> (stage, F's tick) of the row in it
        for t in range(plan.ticks):
            for row in lanes:
                branch = int(row.branch[d, t])
                if not branch:
                    continue
                kind_, s = kinds[branch]
                if kind_ is Kind.F:
                    for pool, slot in (("w", row.res_w[d, t]), ("b", row.bres_w[d, t])):
                        if pool == "b" and s == 0:
                            assert slot == plan.bres_slots  # scratch: stage 0 is not split
                            continue
                        assert int(slot) not in live[pool], (t, pool, slot, live[pool])
                        live[pool][int(slot)] = (s, t)
                    continue
                w_slot, b_slot = int(row.res_r[d, t]), int(row.bres_r[d, t])
                assert live["w"][w_slot][0] == s
                if kind_ is Kind.B:
                    if s > 0:
                        assert live["b"][b_slot][0] == s
                        del live["b"][b_slot]  # B frees its B-pool row
                else:
                    assert b_slot == plan.bres_slots  # W never reads the B-pool
                    del live["w"][w_slot]
        assert not live["b"] and not live["w"]
    assert plan.bres_slots < plan.res_slots


def elementwise_stage(p, a):
    """A layer norm, a dense with bias, a division and a max by parameters, and a
    weight read by both a matmul and an elementwise op."""
    h = nn.LayerNorm().apply({"params": p["ln"]}, a)
    h = jnp.tanh(h @ p["w"] + p["b"])
    h = jnp.maximum(h / p["s"], p["floor"])
    return h * p["w"][0] + h @ p["w"]


def test_elementwise_sites_store_parameter_sized_cotangents():
    """B takes the cotangent of a bias, norm scale or elementwise parameter at its
    parameter operand: the only full-size cotangents B stores are the matmuls',
    W stores no data operand for those sites, and B then W gives jax.vjp's numbers."""
    d, rows = 6, 5
    rng = np.random.default_rng(3)  # numpy inputs: no eager JAX op to compile
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    a, g = normal(rows, d), normal(rows, d)
    p = {
        "ln": {"scale": 1.0 + 0.1 * normal(d), "bias": 0.1 * normal(d)},
        "w": normal(d, d) / np.sqrt(d),
        "b": 0.1 * normal(d),
        "s": 1.5 + np.abs(normal(d)),
        "floor": np.full((d,), -0.2, np.float32),
    }
    sb = SplitBackward(lambda p, a, y: elementwise_stage(p, a), p, a, None)
    full = [c for c in sb.perturbations if c.shape == (rows, d)]
    assert len(full) == 2  # the outputs of the two matmuls by w
    assert sum(np.prod(c.shape) for c in sb.perturbations) == 2 * rows * d + 6 * d
    assert [s.shape for s in sb.stored] == [(rows, d)] * 2  # the matmuls' inputs only

    @jax.jit  # one compile instead of one dispatch per equation
    def split_and_plain(p, a, g):
        out, pull, stored = jax.vjp(
            lambda a, eps: sb.forward(p, a, None, eps), a, sb.zero_perturbations(), has_aux=True
        )
        dinput, cots = pull(g)
        want_out, plain_pull = jax.vjp(elementwise_stage, p, a)
        return (out, dinput, sb.weight_grads(p, stored, cots)), (want_out, *plain_pull(g))

    (out, dinput, got), (want_out, want_p, want_a) = split_and_plain(p, a, g)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    np.testing.assert_allclose(dinput, want_a, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), got, want_p)
