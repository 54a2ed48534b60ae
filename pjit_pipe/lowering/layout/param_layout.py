"""How a device keeps its stages' parameters, and how a chunk's sit inside the tick loop.

SPMD needs one shape on every device, and the stages of a pipeline differ.
An op of stage s needs its parameter tree, and cutting a leaf out of a
longer buffer inside the op copies it: XLA copies any slice that feeds a
matmul (measured on CPU by python -m benchmarks.bench_param_layout: F
7.3-7.9 -> 8.5-9.7 ms, W 6.6 -> 9.0 ms, BW 15.1 -> 18.4 ms on a 4-block MLP
stage, flat against a tree).

So the device state (device_state.py) keeps the parameters in *size
classes* (`device_param_spec`): one whole 1-D buffer per leaf, keyed by
(dtype, number of elements, index), "float32#4096#0". Leaf i of stage s is
a fixed buffer of its class, reshaped, and a reshape of a whole buffer is
free (a bitcast in XLA); the gradient, the optax state (row_optimizer.py:
a row per buffer) and ZeRO's slices (zero.py) follow the same buffers. The
stages held by one buffer array differ, so a class has as many buffers as
the stage with the most leaves of that size, and a stage with fewer leaves
of a size leaves the rest at zero. Nothing is converted between steps or
inside the loop, and asynchronous weights (a version per tick) are whole
buffers too.

Where the classes would hold more than `MAX_CLASS_OVERHEAD` times the bytes
of one flat row per dtype zero padded to the largest stage (stages whose
leaves share few sizes: the classes would then hold every stage's weights
on every device), the device keeps flat rows, and a `ChunkLayout` moves
each chunk into classes of its own stages inside the loop: the row enters
them once per step (a switch on the pipeline position when positions lay
out differently) and the gradient leaves them once, after the loop. A
chunk stays flat there too when its own classes are over the limit, and
where a weight policy picks each tick's weights anew (entering the classes
on every tick would cost more than it saves). An optimizer step inside the
loop (staggered, multi-iteration and re-routed programs) re-enters its new
parameters once, after the step. A chunk whose positions all hold stages of
one layout (uniform chunks: the same blocks everywhere) has no overhead and
needs no switch.

A leaf split over 'tensor' already has a shaped buffer of its own in the row
(packing.py); its class is that buffer, kept in its shape, so the loop reads
and accumulates each device's slice of it and no reshape crosses the split.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pjit_pipe.lowering.layout.flat_buffers import (
    Buffers,
    FlatSpec,
    dtype_of,
    is_shaped,
    replicated,
)

# Classes may hold at most this many times the bytes of the chunk's flat row.
MAX_CLASS_OVERHEAD = 1.25


def device_param_spec(
    avals: Sequence[Any], splits: Sequence[Sequence[Any]] | None, multiple: int
) -> FlatSpec:
    """How the device state keeps every stage's parameters: in size classes
    (`FlatSpec(classes=True)`, a row per leaf size, so an op reads its leaves
    as whole buffers and the loop needs no entering) unless those hold more than
    `MAX_CLASS_OVERHEAD` times one flat row per dtype."""
    spec = FlatSpec(avals, splits=splits, multiple=multiple, classes=True)
    flat = spec.without_classes()
    return spec if spec.total_bytes() <= MAX_CLASS_OVERHEAD * flat.total_bytes() else flat


class ChunkLayout:
    """The in-loop layout of one chunk's parameters and gradient (module docstring).

    `stages[p]` is the virtual stage that pipeline position p holds in this
    chunk; `spec` flattens every virtual stage's parameter tree (tree s is
    stage s). `classes=False` keeps the chunk flat whatever its overhead.
    """

    def __init__(self, spec: FlatSpec, stages: Sequence[int], classes: bool = True):
        self.spec, self.stages = spec, list(stages)
        self.same = spec.same_shapes(self.stages)  # one layout on every position
        # Per stage, the class buffer of each leaf; per class buffer, (elements, dtype),
        # and its shape (a flat class: (elements,); a shaped buffer: its leaf's).
        self.keys: dict[int, list[str]] = {}
        self.sizes: dict[str, tuple[int, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        # Nothing to enter: the device row is already in classes (every leaf whole),
        # or the caller keeps the chunk flat.
        self.flat = spec.classes or not classes
        if self.flat:
            return
        for s in dict.fromkeys(self.stages):
            seen: dict[tuple[str, int], int] = {}
            keys = []
            for key, _, n in spec.slots[s]:
                if is_shaped(key):  # its own buffer already, in its shape
                    keys.append(key)
                    self.sizes[key] = (n, dtype_of(key))
                    self.shapes[key] = spec.shapes[key]
                    continue
                j = seen.get((key, n), 0)
                seen[(key, n)] = j + 1
                keys.append(f"{key}.{n}.{j}")
                self.sizes[keys[-1]] = (n, dtype_of(key))
                self.shapes[keys[-1]] = (n,)
            self.keys[s] = keys
        self.sizes = dict(sorted(self.sizes.items()))
        itemsize = lambda key: np.dtype(key).itemsize  # noqa: E731
        class_bytes = sum(n * itemsize(key) for n, key in self.sizes.values())
        self.flat = not self.same and class_bytes > MAX_CLASS_OVERHEAD * spec.total_bytes()

    def enter(self, row: Buffers, pos: jax.Array) -> Any:
        """The device's flat parameter row -> what the loop carries (`pos`: its
        pipeline position; the row holds the stage `stages[pos]`)."""
        if self.flat:
            return row
        if self.same:
            return self._to_classes(self.stages[0], row)
        return self._switch(self._to_classes, row, pos)

    def leave_pieces(
        self, carried: Any, pos: jax.Array, dtypes: Mapping[str, str] | None = None
    ) -> dict[str, list[jax.Array]]:
        """A carried gradient -> the device's flat row (the inverse of `enter`), as the
        pieces that concatenate into each buffer (`FlatSpec.pieces`): a chunk of one
        layout hands its leaves over without packing them, so the caller builds the
        (v, L) rows of every chunk in one concatenate. `dtypes`: per buffer key, a
        dtype its pieces are cast to instead of the buffer's own (a bf16 gradient
        stays bf16: the cast to float32 and back is one XLA removes)."""
        narrow = functools.partial(_cast, dict(dtypes or {}))
        if self.flat:
            return {k: [b] for k, b in narrow(carried).items()}
        if self.same:
            pieces = self.spec.pieces(self.stages[0], self.unpack(self.stages[0], carried))
            return {k: [narrow({k: p})[k] for p in got] for k, got in pieces.items()}
        to_row = lambda s, bufs: narrow(self._to_row(s, bufs))  # noqa: E731
        return {k: [b] for k, b in self._switch(to_row, carried, pos).items()}

    def leave(
        self, carried: Any, pos: jax.Array, dtypes: Mapping[str, str] | None = None
    ) -> Buffers:
        """A carried gradient -> this chunk's flat buffers (`leave_pieces`, joined)."""
        return {
            k: jnp.concatenate([jnp.ravel(p) for p in pieces]).reshape(self.spec.shapes[k])
            for k, pieces in self.leave_pieces(carried, pos, dtypes).items()
        }

    def _switch(self, convert: Any, bufs: Any, pos: jax.Array) -> Any:
        """convert(stages[pos], bufs): a switch on the position. Shaped buffers (split
        over 'tensor') are the same in both layouts and stay out of it, and the flat
        part is pinned replicated over 'tensor' on both sides: a value resharded
        inside a branch that one stage's devices take would put a collective there
        (tick.py's rule; docs/tensor_parallel.md)."""
        if not self.spec.tensor_split:
            return lax.switch(pos, [functools.partial(convert, s) for s in self.stages], bufs)
        shaped = {k: b for k, b in bufs.items() if is_shaped(k)}

        def branch(s: int, flat: Any) -> Any:
            out = convert(s, {**flat, **shaped})
            return replicated({k: b for k, b in out.items() if not is_shaped(k)})

        flat = replicated({k: b for k, b in bufs.items() if not is_shaped(k)})
        branches = [functools.partial(branch, s) for s in self.stages]
        # A shaped buffer that no stage of this chunk holds (the head, say, held
        # by another chunk's stage) is absent from the carried gradient and zero
        # in the row, as `FlatSpec.pack` makes it.
        absent = {
            k: jnp.zeros(self.spec.shapes[k], dtype_of(k))
            for k in self.spec.sizes
            if is_shaped(k) and k not in shaped
        }
        return {**absent, **lax.switch(pos, branches, flat), **shaped}

    def unpack(self, s: int, carried: Any) -> Any:
        """Stage s's parameter tree (inside its op): reshapes, or flat slices."""
        if self.flat:
            return self.spec.unpack(s, carried)
        leaves = [
            carried[k].reshape(a.shape)
            for k, a in zip(self.keys[s], self.spec.avals[s], strict=True)
        ]
        return jax.tree.unflatten(self.spec.treedefs[s], leaves)

    def pack(self, s: int, tree: Any) -> Any:
        """Stage s's gradient tree in the carried layout (zeros in the classes
        stage s does not use)."""
        if self.flat:
            return self.spec.pack(s, tree)
        leaves = jax.tree.leaves(tree)
        got = {k: a.reshape(self.shapes[k]) for k, a in zip(self.keys[s], leaves, strict=True)}
        return {
            k: got[k] if k in got else jnp.zeros(self.shapes[k], key)
            for k, (_, key) in self.sizes.items()
        }

    def zeros(self) -> Any:
        """An empty gradient accumulator in the carried layout."""
        if self.flat:
            return self.spec.zeros()
        return {k: jnp.zeros(self.shapes[k], key) for k, (_, key) in self.sizes.items()}

    def _to_classes(self, s: int, row: Buffers) -> Any:
        return self.pack(s, self.spec.unpack(s, row))

    def _to_row(self, s: int, carried: Any) -> Buffers:
        return self.spec.pack(s, self.unpack(s, carried))


def _cast(dtypes: Mapping[str, str], bufs: Buffers) -> Buffers:
    """Each buffer of `bufs` named in `dtypes` cast to that dtype."""
    return {k: b.astype(dtypes[k]) if k in dtypes else b for k, b in bufs.items()}
