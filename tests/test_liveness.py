"""The cutter's jaxpr reading (frontend/cutter/analysis.py) on the installed JAX.

Each jaxpr is built by JAX itself, so the params of its scans and calls are in
whatever form the installed release gives them; the expected answers follow
from how each function is written.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive

import pjit_pipe as pp
from pjit_pipe.frontend.cutter.analysis import liveness

VEC = jax.ShapeDtypeStruct((2,), jnp.float32)
MAT = jax.ShapeDtypeStruct((2, 2), jnp.float32)


def _live(f, *avals):
    return liveness(jax.make_jaxpr(f)(*avals).jaxpr)


def test_scan_carries_reach_the_output_through_each_other():
    # carry (a, b, c): a' = b, b' = c @ w, c' = c; xs feed only the dead ys.
    def f(a, b, c, w, xs, out):
        def body(carry, x):
            _, b, c = carry
            return (b, c @ w, c), x * 2.0

        (a, b, c), ys = jax.lax.scan(body, (a, b, c), xs)
        return (a, b, c, ys)[out]

    args = [VEC, VEC, VEC, MAT, jax.ShapeDtypeStruct((3, 2), jnp.float32)]
    # Final a is the b of the step before, which is c @ w: everything but xs after 3 steps.
    assert _live(lambda *a: f(*a, out=0), *args).used == (True, True, True, True, False)
    # Final c is c: the other carries, w and xs are dead code.
    assert _live(lambda *a: f(*a, out=2), *args).used == (False, False, True, False, False)
    # ys read xs only.
    assert _live(lambda *a: f(*a, out=3), *args).used == (False, False, False, False, True)
    # FLOPs: 3 steps of one (2,) @ (2, 2) product, 2 * 2 * 2 each; the dead ys cost nothing.
    assert _live(lambda *a: f(*a, out=1), *args).flops == 3 * 8


def test_cond_costs_its_costliest_branch_and_reads_both_branches_inputs():
    def f(p, x, w, v):
        return jax.lax.cond(p, lambda x, w, v: x @ w, lambda x, w, v: x * 1.0, x, w, v)

    live = _live(f, jax.ShapeDtypeStruct((), bool), VEC, MAT, VEC)
    assert live.used == (True, True, True, False)
    # The matmul branch (2 * 2 * 2), not both (+ 2), besides the predicate's turn into an index.
    assert 8 <= live.flops < 8 + 2


def test_an_unknown_primitive_with_a_sub_jaxpr_reads_all_its_inputs():
    opaque = Primitive("opaque_call_for_test")
    opaque.multiple_results = True
    opaque.def_abstract_eval(lambda *avals, body: body.out_avals)
    body = jax.make_jaxpr(lambda x, unused: [x @ x])(MAT, MAT)

    live = _live(lambda x, y, z: opaque.bind(x, y, body=body)[0], MAT, MAT, MAT)
    # The body ignores its second input, but nothing says the primitive does.
    assert live.used == (True, True, False)
    assert live.flops == 2 * 4 * 2  # its body's (2, 2) @ (2, 2)


def test_an_equation_of_an_unexpected_form_names_its_primitive_and_the_jax_version():
    # A dot_general without its dimension_numbers param, as a release that renamed it would give.
    renamed = Primitive("dot_general")
    renamed.def_abstract_eval(lambda x, w, **params: x)
    jaxpr = jax.make_jaxpr(lambda x, w: renamed.bind(x, w, dims=(((0,), (0,)), ((), ()))))(MAT, MAT)

    with pytest.raises(pp.JaxprError) as raised:
        liveness(jaxpr.jaxpr)
    message = str(raised.value)
    assert "'dot_general'" in message and f"jax {jax.__version__}" in message
    assert isinstance(raised.value, pp.CutError) and isinstance(raised.value.__cause__, KeyError)
