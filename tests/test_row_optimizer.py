"""The optax step on whole flat rows: which updates take it, and that it gives
optax's own numbers on each stage's tree (row_optimizer.py, leafwise.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe.lowering.layout.flat_buffers import FlatSpec
from pjit_pipe.lowering.layout.row_optimizer import RowOptimizer, why_not_rows
from pjit_pipe.models import ResidualMLP, mse_loss
from tests.test_opt_state import is_matrix, label

# Three stages of different layouts, one with a bf16 leaf (a second row dtype).
STAGES = [
    {"emb": jnp.zeros((5, 4)), "ln": {"scale": jnp.zeros((4,)), "bias": jnp.zeros((4,))}},
    {"w": jnp.zeros((4, 4)), "b": jnp.zeros((4,))},
    {"head": jnp.zeros((4, 3)), "b": jnp.zeros((3,), jnp.bfloat16)},
]
SPEC = FlatSpec(STAGES)


LEAFWISE = {
    "adam": optax.adam(1e-2),
    "adamw": optax.adamw(1e-2, weight_decay=0.1),
    "momentum": optax.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": optax.lion(1e-3),
    "scheduled rmsprop": optax.rmsprop(optax.linear_schedule(1e-2, 1e-3, 10)),
}
PER_LEAF = {
    "a mask over the tree": optax.adamw(1e-2, mask=is_matrix),
    "masked": optax.masked(optax.adam(1e-2), is_matrix),
    "multi_transform": optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.1)}, label
    ),
    "a global-norm clip": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "per-leaf norms (lamb)": optax.lamb(1e-2),
    "factored moments": optax.adafactor(1e-2),
    "noise, one key per leaf": optax.chain(optax.add_noise(0.1, 0.5, 0), optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", list(PER_LEAF))
def test_updates_that_differ_between_leaves_keep_the_per_leaf_step(name):
    assert why_not_rows(PER_LEAF[name], SPEC) is not None
    assert RowOptimizer.fit(PER_LEAF[name], SPEC) is None


@pytest.mark.parametrize("name", list(LEAFWISE))
def test_a_row_step_gives_optax_numbers_on_every_stage(name):
    opt = LEAFWISE[name]
    rows = RowOptimizer.fit(opt, SPEC)
    assert rows is not None, why_not_rows(opt, SPEC)
    rng = np.random.default_rng(0)

    def draw(tree):
        return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), tree)

    params = [draw(t) for t in STAGES]
    states = [opt.init(p) for p in params]
    step = jax.jit(rows.step)
    # Two steps, so the state read back from the rows is a stepped one.
    for _ in range(2):
        grads = [draw(t) for t in STAGES]
        bufs = [
            {k: jnp.stack([spec.pack(s, trees[s])[k] for s in range(3)]) for k in spec.sizes}
            for spec, trees in ((SPEC, params), (SPEC, grads), (rows.spec, states))
        ]
        new_p, new_o = step(*bufs)
        expected = []
        for p, g, o in zip(params, grads, states, strict=True):
            updates, o = opt.update(g, o, p)
            expected.append((optax.apply_updates(p, updates), o))
        for s, (p, o) in enumerate(expected):
            got_p = SPEC.unpack(s, {k: b[s] for k, b in new_p.items()})
            got_o = rows.spec.unpack(s, {k: b[s] for k, b in new_o.items()})
            assert jax.tree.structure(got_o) == jax.tree.structure(o)
            for a, b in zip(jax.tree.leaves((got_p, got_o)), jax.tree.leaves((p, o)), strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_allclose(
                    np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1e-7
                )
        params, states = [p for p, _ in expected], [o for _, o in expected]


def test_the_optax_rows_hold_each_stage_state_at_its_parameters_offsets():
    rows = RowOptimizer.fit(optax.adam(1e-2), SPEC)
    L = SPEC.sizes["float32"]
    for s in range(3):
        state = optax.adam(1e-2).init(STAGES[s])
        mu = jax.tree.map(lambda a: a + 1.0, state[0].mu)
        nu = jax.tree.map(lambda a: a + 2.0, state[0].nu)
        packed = rows.spec.pack(s, (state[0]._replace(mu=mu, nu=nu), *state[1:]))
        assert (rows.spec.sizes["float32+0"], rows.spec.sizes["float32+1"]) == (L, L)
        used = [(start, n) for key, start, n in SPEC.slots[s] if key == "float32"]
        for start, n in used:  # mu and nu each in a row of their own, at the row's offsets
            assert bool(jnp.all(packed["float32+0"][start : start + n] == 1.0))
            assert bool(jnp.all(packed["float32+1"][start : start + n] == 2.0))


def test_a_row_step_told_not_to_keep_returns_its_inputs():
    opt = LEAFWISE["adamw"]
    rows = RowOptimizer.fit(opt, SPEC)
    rng = np.random.default_rng(1)
    params, grads = (
        {k: jnp.asarray(rng.normal(size=(3, n)), k) for k, n in SPEC.sizes.items()} for _ in "pg"
    )
    states = [opt.init(SPEC.unpack(s, {k: b[s] for k, b in params.items()})) for s in range(3)]
    opt_rows = {
        k: jnp.stack([rows.spec.pack(s, states[s])[k] for s in range(3)]) for k in rows.spec.sizes
    }
    step = jax.jit(rows.step)
    kept = step(params, grads, opt_rows, jnp.array(True))
    for a, b in zip(
        jax.tree.leaves(kept), jax.tree.leaves(step(params, grads, opt_rows)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    skipped = step(params, grads, opt_rows, jnp.array(False))
    for a, b in zip(jax.tree.leaves(skipped), jax.tree.leaves((params, opt_rows)), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))
    # One flag per chunk (the stepping loop's chunks that step): rows 0 and 2 take the
    # step, row 1 keeps its inputs.
    mixed = step(params, grads, opt_rows, jnp.array([True, False, True]))
    for got, new, old in zip(
        jax.tree.leaves(mixed),
        jax.tree.leaves(kept),
        jax.tree.leaves((params, opt_rows)),
        strict=True,
    ):
        for row, want in ((0, new), (1, old), (2, new)):
            np.testing.assert_array_equal(
                np.asarray(got[row], np.float64), np.asarray(want[row], np.float64)
            )


@pytest.mark.parametrize("chunks", [1, 2])
def test_adam_steps_its_rows_in_the_temporary_memory_of_stateless_sgd(chunks):
    """The compiled train step (the non-finite check on) with adam needs no more
    temporary memory than with plain sgd, which keeps no state: adam's moments
    and the parameters are written over the donated rows they are read from,
    with no row-long temporary, concatenate or copy."""
    model = ResidualMLP(d_model=16, hidden=32, n_layers=4, d_out=4)
    x = np.random.default_rng(0).normal(size=(8, 16)).astype(np.float32)
    y = x[:, :4]
    temp, row = {}, 0
    for name, opt in (("sgd", optax.sgd(1e-2)), ("adam", optax.adam(1e-2))):
        pm = pp.pipeline(
            model,
            stages=1,
            microbatches=4,
            schedule="interleaved-1f1b" if chunks == 2 else "1f1b",
            chunks=chunks if chunks == 2 else None,
            mesh=pp.make_mesh(data=1, stage=1),
            optimizer=opt,
        )
        step = pm.train_step(mse_loss)
        state = step.init(model.init(jax.random.key(0), x[:1]), (x, y))
        program, _ = step._state_program(state, (x, y))
        assert step._skips(program)
        params, opt_rows = program.layout.avals()
        if name == "adam":
            # mu and nu: a row of their own for every parameter buffer
            assert len([k for k in opt_rows if "+" in k]) == 2 * len(params)
        jitted = program._device_steps[(True, True)].jitted
        compiled = jitted.lower(params, opt_rows, x, y).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
        row = sum(a.size * a.dtype.itemsize for a in params.values())
    # The XLA of jaxlib 0.10 copies the old moments (two rows) for the parameters'
    # kernels first; 0.11 and later do not.
    assert temp["adam"] - temp["sgd"] < (row / 4 if jax.__version_info__ >= (0, 11) else 2 * row)
