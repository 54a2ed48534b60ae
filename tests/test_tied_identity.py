"""Tied weights are summed by identity, never by layout.

A tied leaf (an embedding that later stages reuse through `attend`) sits in
each holding stage's parameters beside that stage's own leaves, and the device
layout (flat_buffers.py) may keep it under a different buffer and offset on
each holder: a size class counts the same-sized leaves that come earlier in
its stage's tree, and a shaped buffer (a leaf split over 'tensor') counts the
same-shaped ones. The gradient's total must still gather every holder's part
of that one leaf.

The models here are generated (hypothesis): one segment per virtual stage,
each with leaves of random shapes, names and 'tensor' splits, many of them
exactly as large as the tied table, and the tied unit's name drawn so that it
sorts before, between or after the segments. The table is tied across 2 to 4
virtual stages. Every schedule kind's gradient equals `jax.value_and_grad`,
also on tensor > 1 and on a failure variant; with an optimizer, without ZeRO,
with ZeRO-1 and with ZeRO-3, the pipelined step equals optax's (every kind
but async-1f1b, which trains on stale weights by design).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pjit_pipe as pp
from pjit_pipe.schedules import DEFAULT_CHUNKS as KINDS  # every kind, its chunks per device
from tests.numerics import rel_err

# Segments of random sizes cut where the markers stand, however uneven.
pytestmark = pytest.mark.filterwarnings("ignore:pipeline. the best cut:UserWarning")

VOCAB, WIDTH = 8, 4  # the tied table is (VOCAB, WIDTH): 32 elements
ROWS, LENGTH, MICROBATCHES = 8, 3, 4
# Leaf shapes a segment draws from: most hold as many elements as the table.
SHAPES = ((VOCAB, WIDTH), (WIDTH, VOCAB), (VOCAB * WIDTH,), (2, 16), (WIDTH, WIDTH), (WIDTH,))
LEAF_NAMES = ("alpha", "beta", "kappa", "omega", "zeta")
TIED_NAMES = ("a_table", "r_table", "z_table")  # before, between and after "seg_*"
# async-1f1b trains on stale weights by design (test_async_lowering.py checks its
# rule); its gradient of one batch is the plain one, like every other kind's.
SYNCHRONOUS = tuple(k for k in KINDS if k != "async-1f1b")
TOL = 1e-4  # float32 sums in another order; a missed holder's part is O(1)

Leaf = tuple[str, tuple[int, ...], tuple[str | None, ...] | None]  # name, shape, split


def _init(split: tuple[str | None, ...] | None) -> Any:
    init = nn.initializers.normal(0.5)
    return nn.with_partitioning(init, split) if split else init


class Segment(nn.Module):
    """One virtual stage's own leaves; each scales the hidden state by a function
    of all its elements, so every element has its own gradient."""

    leaves: tuple[Leaf, ...]

    @nn.compact
    def __call__(self, h: jax.Array, head: jax.Array | None = None) -> jax.Array:
        for name, shape, split in self.leaves:
            w = self.param(name, _init(split), shape)
            pattern = jnp.cos(jnp.arange(w.size, dtype=h.dtype)).reshape(shape)
            s = jnp.mean(jnp.sin(w) * pattern)
            h = h * (1 + 0.1 * jnp.tanh(s + jnp.mean(h, axis=-1, keepdims=True)))
        if head is not None:  # the tied table's product on a middle holder
            h = h + 0.1 * jnp.tanh(head) @ self.param("mix", _init(None), (VOCAB, WIDTH))
        return h


class TiedStack(nn.Module):
    """Token lookup in the tied table, one segment per virtual stage (cut at
    `pp.boundary`), the table's `attend` on every holder after the first, and
    the last holder's `attend` as the LM head."""

    segments: tuple[tuple[Leaf, ...], ...]
    holders: tuple[int, ...]  # virtual stages reading the table: 0, the last, maybe more
    tied_name: str
    tied_split: tuple[str | None, ...] | None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = nn.Embed(VOCAB, WIDTH, embedding_init=_init(self.tied_split), name=self.tied_name)
        h = table(tokens)
        last = len(self.segments) - 1
        for k, leaves in enumerate(self.segments):
            if k:
                h = pp.boundary(h)
            middle = k in self.holders and 0 < k < last
            h = Segment(leaves, name=f"seg_{k}")(h, table.attend(h) if middle else None)
        return table.attend(h)


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@st.composite
def cases(draw: st.DrawFn, kinds: tuple[str, ...] = tuple(KINDS)) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(kinds)))
    chunks = KINDS[kind]
    stages = draw(st.sampled_from((2, 4) if chunks == 1 else (2,)))
    # async-1f1b takes microbatches >= stages, flat weight rows (tensor 1) and no
    # failures; it refuses the rest by name.
    asynchronous = kind == "async-1f1b"
    meshes = [
        (d, t)
        for d, t in (((1, 1), (2, 1)) if asynchronous else ((1, 2), (2, 1), (2, 2)))
        if d * stages * t <= 8 and (not asynchronous or MICROBATCHES // d >= stages)
    ]
    data, tensor = draw(st.sampled_from(meshes))
    n = stages * chunks
    middle = draw(st.sets(st.integers(1, n - 2), max_size=min(2, n - 2))) if n > 2 else set()

    def split(shape: tuple[int, ...]) -> tuple[str | None, ...] | None:
        if tensor == 1 or len(shape) != 2 or not draw(st.booleans()):
            return None
        return (None, "tensor") if draw(st.booleans()) else ("tensor", None)

    segments = []
    for _ in range(n):
        names = draw(st.lists(st.sampled_from(LEAF_NAMES), max_size=4, unique=True))
        segments.append(
            tuple((name, s, split(s)) for name in names for s in [draw(st.sampled_from(SHAPES))])
        )
    replicas_down = draw(st.booleans()) if data > 1 and not asynchronous else False
    return {
        "kind": kind,
        "chunks": chunks,
        "mesh": (data, stages, tensor),
        "model": TiedStack(
            segments=tuple(segments),
            holders=tuple(sorted({0, n - 1, *middle})),
            tied_name=draw(st.sampled_from(TIED_NAMES)),
            tied_split=split((VOCAB, WIDTH)),
        ),
        "failed": [(draw(st.integers(0, data - 1)), draw(st.integers(0, stages - 1)))]
        if replicas_down
        else [],
        # ZeRO-1 shards the optax state, ZeRO-3 the parameters too (tensor 1 only)
        "zero": draw(st.sampled_from((0, 1, 3) if tensor == 1 else (0, 1))) if data > 1 else 0,
    }


def _pipeline(case: dict[str, Any], **options: Any) -> pp.Pipelined:
    data, stages, tensor = case["mesh"]
    pm = pp.pipeline(
        case["model"],
        stages=stages,
        microbatches=MICROBATCHES // data,
        schedule=case["kind"],
        chunks=case["chunks"],
        mesh=pp.make_mesh(data=data, stage=stages, tensor=tensor),
        costs=pp.Costs.parse("1,2,1") if case["kind"] == "auto" else None,
        **options,
    )
    # While a worker is down its stage's survivors hold the whole optax state
    # (`with_failures` joins ZeRO's slices), as the runtime does.
    return pm.with_failures(case["failed"]) if case["failed"] else pm


def _batch() -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(3), (ROWS, LENGTH + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:]


def check_gradients(case: dict[str, Any]) -> None:
    """The pipelined loss and every gradient leaf equal plain JAX's."""
    x, y = _batch()
    params = case["model"].init(jax.random.key(0), x)
    plain = nn.meta.unbox(params)
    want_loss, want = jax.value_and_grad(lambda p: xent(case["model"].apply(p, x), y))(plain)
    loss, grads = _pipeline(case).value_and_grad(xent)(params, x, y)
    assert abs(float(loss) - float(want_loss)) <= TOL * abs(float(want_loss))
    got = nn.meta.unbox(grads)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = _at(want, path)
        assert rel_err(g, w) <= TOL, (jax.tree_util.keystr(path), rel_err(g, w))


def check_training(case: dict[str, Any]) -> None:
    """Two steps of SGD with momentum, with the case's ZeRO, equal optax's."""
    x, y = _batch()
    params = case["model"].init(jax.random.key(0), x)
    optimizer = optax.sgd(0.5, momentum=0.9)
    step = _pipeline(case, optimizer=optimizer, zero=case["zero"]).train_step(xent)
    state = step.init(params, (x, y))
    want = nn.meta.unbox(params)
    opt_state = optimizer.init(want)
    for _ in range(2):
        want_loss, grads = jax.value_and_grad(lambda p: xent(case["model"].apply(p, x), y))(want)
        updates, opt_state = optimizer.update(grads, opt_state, want)
        want = optax.apply_updates(want, updates)
        state, loss = step(state, (x, y))
        assert abs(float(loss) - float(want_loss)) <= TOL * abs(float(want_loss))
    assert rel_err(nn.meta.unbox(state.params), want) <= TOL


def _at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key.key]
    return tree


# A hand-written case that the layout got wrong: the table is the first leaf of
# its size on stage 0 but the fifth on stage 1, behind the last segment's
# same-sized leaves.
REGRESSION = {
    "kind": "1f1b",
    "chunks": 1,
    "mesh": (2, 2, 1),
    "model": TiedStack(
        segments=(
            (("alpha", (WIDTH, WIDTH), None),),
            tuple((name, (VOCAB * WIDTH,), None) for name in ("alpha", "beta", "kappa", "omega")),
        ),
        holders=(0, 1),
        tied_name="z_table",
        tied_split=None,
    ),
    "failed": [],
    "zero": 1,
}


@pytest.mark.quick
def test_a_tied_table_in_different_size_classes_gets_the_summed_gradient():
    check_gradients(REGRESSION)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_a_tied_table_in_different_size_classes_trains_like_optax_under_zero(zero):
    check_training({**REGRESSION, "zero": zero})


PROPERTY = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,  # the same cases in every run: CI reproduces what it found
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow
@PROPERTY
@given(cases())
def test_generated_tied_models_get_plain_gradients(case):
    check_gradients(case)


@pytest.mark.slow
@settings(PROPERTY, max_examples=6)
@given(cases(SYNCHRONOUS))
def test_generated_tied_models_train_like_optax(case):
    check_training(case)
