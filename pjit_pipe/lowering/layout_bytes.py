"""Bytes a device holds of the lowering's buffers, for the memory report
(memory_prediction.py): a chunk's buffer or row in a given dtype, split over
'tensor' where its leaf is, a W's output, and a stage's own unpadded state."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from pjit_pipe.lowering.layout.flat_buffers import FlatSpec, dtype_of, is_shaped
from pjit_pipe.lowering.layout.tensor_layout import LeafSplits


def buffer_bytes(spec: FlatSpec, key: str, tensor: int, dtype: str | None = None) -> int:
    """Bytes one device holds of one chunk's buffer `key` (in `dtype`, if given, else
    its own): a shaped buffer split over 'tensor' is cut T ways, a flat row is
    whole on every tensor device."""
    itemsize = np.dtype(dtype or dtype_of(key)).itemsize
    whole = int(np.prod(spec.shapes[key], dtype=np.int64)) * itemsize
    if is_shaped(key) and "tensor" in spec.split_of(key):
        return whole // tensor
    return whole


def row_bytes(spec: FlatSpec, tensor: int, dtypes: dict[str, str] | None = None) -> int:
    """Bytes one device holds of one chunk's row of every buffer of `spec` (a buffer
    named in `dtypes` in that dtype)."""
    return sum(buffer_bytes(spec, key, tensor, (dtypes or {}).get(key)) for key in spec.sizes)


def w_output_bytes(
    spec: FlatSpec, tensor: int, compute: dict[str, str], reduce: dict[str, str] | None, D: int
) -> int:
    """Bytes of one W's output on a device: the chunk's parameter gradient in its
    compute dtype (bf16 where the model reads a weight through a cast to bf16). With
    slices (`reduce`: ZeroLayout.reduce_dtypes) each buffer is packed into the row it
    is reduce-scattered in, written in place where the dtypes agree and beside the
    gradient where not, and the slice that leaves is held too."""
    total = 0
    for k in spec.sizes:
        grad = buffer_bytes(spec, k, tensor, compute.get(k))
        if reduce is None:
            total += grad
            continue
        row = buffer_bytes(spec, k, tensor, reduce.get(k))
        same = reduce.get(k, dtype_of(k)) == compute.get(k, dtype_of(k))
        total += row + row // D + (0 if same else grad)
    return total


def own_bytes(
    avals: Any,
    split: LeafSplits | None,
    optimizer: optax.GradientTransformation,
    tensor: int,
) -> tuple[int, int]:
    """(parameter, optax-state) bytes of one stage on one device, unpadded: a leaf
    split over 'tensor' counts its slice."""
    leaves = jax.tree.leaves(avals)
    cut = split if split is not None else [None] * len(leaves)
    params = 0
    for a, how in zip(leaves, cut, strict=True):
        b = int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        params += b // tensor if how is not None and "tensor" in how else b
    whole = sum(a.size * np.dtype(a.dtype).itemsize for a in leaves)
    state = jax.eval_shape(optimizer.init, avals)
    opt = sum(
        int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        for a in jax.tree.leaves(state)
    )
    # The optax state splits over 'tensor' as its parameters do.
    return params, opt * params // max(whole, 1)
