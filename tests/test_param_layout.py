"""Size classes (lowering/layout/param_layout.py, flat_buffers.py): what goes in comes
back out, per position and per stored row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pjit_pipe.lowering.layout.flat_buffers import FlatSpec
from pjit_pipe.lowering.layout.param_layout import MAX_CLASS_OVERHEAD, ChunkLayout

SHAPES = [(3,), (2, 3), (3, 2), (4,), (2, 2)]  # (2, 3) and (3, 2) share a class


@st.composite
def stage_trees(draw):
    """2-3 stage parameter dicts of a few leaves drawn from SHAPES (some f16)."""
    trees = []
    for s in range(draw(st.integers(2, 3))):
        names = draw(st.lists(st.sampled_from("abcde"), min_size=1, max_size=4, unique=True))
        tree = {}
        for i, name in enumerate(sorted(names)):
            shape = draw(st.sampled_from(SHAPES))
            dtype = jnp.float16 if draw(st.booleans()) and i == 0 else jnp.float32
            tree[name] = (s + 1) * jnp.arange(np.prod(shape), dtype=dtype).reshape(shape) + i
        trees.append(tree)
    return trees


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stage_trees())
def test_every_position_gets_its_own_tree_back(trees):
    spec = FlatSpec(trees)
    stages = list(range(len(trees)))  # position p holds stage p
    layout = ChunkLayout(spec, stages)
    flat_bytes = sum(n * np.dtype(k).itemsize for k, n in spec.sizes.items())
    class_bytes = sum(n * np.dtype(k).itemsize for n, k in layout.sizes.values())
    assert layout.flat == (class_bytes > MAX_CLASS_OVERHEAD * flat_bytes and not layout.same)
    for p, s in enumerate(stages):
        row = spec.pack(s, trees[s])
        carried = layout.enter(row, jnp.int32(p))
        # an op of stage s reads its own tree, whatever the others hold
        assert_trees_equal(layout.unpack(s, carried), trees[s])
        # a gradient packed by stage s leaves as stage s's flat row
        pieces = layout.leave_pieces(layout.pack(s, trees[s]), jnp.int32(p))
        back = {k: jnp.concatenate(got) for k, got in pieces.items()}
        for k in spec.sizes:
            np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(row[k]))
        if not layout.flat:  # each leaf is a whole buffer: no slicing inside the op
            keys = layout.keys[s]
            assert len(set(keys)) == len(keys)
            for k, leaf in zip(keys, jax.tree.leaves(trees[s]), strict=True):
                assert layout.sizes[k] == (leaf.size, np.dtype(leaf.dtype).name)


def test_uniform_stages_need_no_switch_and_unrelated_ones_stay_flat():
    same = [{"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}] * 3
    layout = ChunkLayout(FlatSpec(same), [0, 1, 2])
    assert layout.same and not layout.flat
    assert sum(n for n, _ in layout.sizes.values()) == 20  # no overhead
    unrelated = [{"w": jnp.ones((5,))}, {"w": jnp.ones((7,))}, {"w": jnp.ones((9,))}]
    assert ChunkLayout(FlatSpec(unrelated), [0, 1, 2]).flat  # 21 elements against 9
    assert ChunkLayout(FlatSpec(same), [0, 1, 2], classes=False).flat
    # a uniform chunk's gradient leaves leaf by leaf, in its flat row's order
    trees = [
        {"w": jnp.arange(16.0).reshape(4, 4) + 100 * s, "b": -jnp.arange(4.0)} for s in range(3)
    ]
    spec = FlatSpec(trees)
    pieces = layout.leave_pieces(layout.pack(1, trees[1]), jnp.int32(1))
    for k, row in spec.pack(1, trees[1]).items():
        np.testing.assert_array_equal(np.asarray(jnp.concatenate(pieces[k])), np.asarray(row))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stage_trees(), st.sampled_from([1.0, 1.25, 2.0]))
def test_compact_classes_keep_the_limit_and_store_rows_leaf_by_leaf(trees, limit):
    """The residual pools' layout: every leaf in a size class where all classes fit
    in `limit` times the flat row's bytes (both counted here from the leaves),
    never more bytes than that, and a tree written into a row of a store, leaf by
    leaf, reads back whole."""
    spec = FlatSpec.compact_classes(trees, limit)
    itemsize = lambda leaf: np.dtype(leaf.dtype).itemsize  # noqa: E731
    flat = {}  # dtype -> the largest tree's elements of it
    most = {}  # (dtype, size) -> the most leaves of that size in one tree
    for tree in trees:
        per_dtype, per_size = {}, {}
        for leaf in jax.tree.leaves(tree):
            key = (np.dtype(leaf.dtype).name, leaf.size)
            per_dtype[key[0]] = per_dtype.get(key[0], 0) + leaf.size * itemsize(leaf)
            per_size[key] = per_size.get(key, 0) + 1
        for k, n in per_dtype.items():
            flat[k] = max(flat.get(k, 0), n)
        for k, n in per_size.items():
            most[k] = max(most.get(k, 0), n)
    class_bytes = sum(n * size * np.dtype(k).itemsize for (k, size), n in most.items())
    assert spec.classes == (class_bytes <= limit * sum(flat.values()))
    assert spec.total_bytes() <= limit * sum(flat.values())
    store = spec.zeros(3)
    for s, tree in enumerate(trees):
        row = spec.write(s, store, 1, jax.tree.leaves(tree))
        assert_trees_equal(spec.unpack(s, {k: b[1] for k, b in row.items()}), tree)


def test_a_size_every_tree_has_gets_a_class_at_no_cost():
    """Trees of leaf sizes {4, 4, 8} and {4, 16}: a flat row of 20 elements. One
    class of 4 holds what both rows held (4 + a flat row of max(12, 16)); a
    second class of 4, or a class of 8 or 16, would cost more."""
    trees = [[jnp.ones(4), jnp.ones(4), jnp.ones(8)], [jnp.ones(4), jnp.ones(16)]]
    spec = FlatSpec.compact_classes(trees, 1.0)
    assert spec.sizes == {"float32": 16, "float32#4#0": 4}
    assert not spec.classes
    assert FlatSpec.compact_classes(trees, 2.0).classes  # 4 + 4 + 8 + 16 = 32 elements
