"""One virtual stage's ops compiled alone, as the tick program runs them, for timing.

`costs="measure"` (measure.py) and `remat="auto"` (residual_choice.py) time a
stage's F, B, W and BW outside the pipeline. Each must cost what it costs in
the compiled step, so each is built from the same `StageVjp` methods the
lowering calls, and an op that writes into a residual store in place there (F
its residuals, B its cotangents) writes into a donated store here: each call
writes into the store the call before returned, with no copy of the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.lowering import FlatSpec, StageVjp


def ones_on(avals: Any, device: jax.Device) -> Any:
    """Arrays of ones shaped like `avals`, on `device`."""
    return jax.tree.map(lambda a: jax.device_put(jnp.ones(a.shape, a.dtype), device), avals)


def _writing(op: Callable, store: Any) -> tuple[Callable[[], Any], Any]:
    """(a call of `op(store) -> (value, store)` that donates the store the call
    before returned, the first call's store)."""
    held = list(op(store))  # [value, store]

    def call() -> Any:
        held[:] = op(held[1])
        return held[0]

    return call, held[1]


def stage_programs(
    st: StageVjp, s: int, device: jax.Device, y_mb: Any, flat: FlatSpec | None = None
) -> dict[str, Callable[[], Any]]:
    """Stage s's ops as the lowering runs them with `st`, on `device`, each a
    callable of no arguments: F, B and W of a split stage, F and BW of any other
    (the first stage's BW is its W: no input gradient), and on an unsplit loss
    stage FBW, its F and backward as one program (lowering.plan.FUSED; the same
    program whatever the split, so timed once).

    With `flat`, the parameters come packed in it and the gradients go back
    packed, as the lowering keeps a chunk that it does not hold in size classes
    (`lowering.param_layout.ChunkLayout`): each op then pays the copies of its
    weights out of the flat buffer that the compiled program pays."""
    p = ones_on(st.param_avals[s], device)
    pack, unpack = lambda q: q, lambda q: q
    if flat is not None:
        pack, unpack = (lambda q: flat.pack(s, q)), (lambda q: flat.unpack(s, q))
        p = jax.device_put(pack(p), device)
    a = ones_on(st.act_avals[s], device)
    y = ones_on(y_mb, device) if s == st.S - 1 else None
    # The last stage's output is the loss vector (loss.LossLayout): seed its value.
    g = (
        jax.device_put(jnp.zeros(st.loss_aval.shape, st.loss_aval.dtype).at[0].set(1.0), device)
        if s == st.S - 1
        else ones_on(st.act_avals[s + 1], device)
    )
    f = jax.jit(lambda p, a, y, r: st.forward_into(s, unpack(p), a, y, r, 0, 0), donate_argnums=3)
    forward, store = _writing(lambda r: f(p, a, y, r), st.zero_residuals(1))
    res = jax.tree.map(lambda b: b[0], store)  # what B and W read (B's cotangents: zeros)
    ops = {"F": forward}
    if s in st.split:
        b = jax.jit(lambda p, r, g, ws: st.input_grad(s, unpack(p), r, g, ws, 0), donate_argnums=3)
        w = jax.jit(lambda p, r: pack(st.weight_grad(s, unpack(p), r)))
        w_store = jax.tree.map(lambda v: v[None], res.w)  # a one-slot W-pool
        ops |= {"B": _writing(lambda ws: b(p, res, g, ws), w_store)[0], "W": lambda: w(p, res)}
    else:

        def fused_backward(p, r):
            grads = st.pullback(s, unpack(p), r)(g)  # the first stage's: (dparams,)
            return (pack(grads[0]), *grads[1:])

        bw = jax.jit(fused_backward)
        ops |= {"BW": lambda: bw(p, res)}
    if s == st.S - 1 and s not in st.split:

        def value_and_grad(p, a, y):
            out, dparams, dinput = st.value_and_grad(s, unpack(p), a, y, g)
            return out, pack(dparams), dinput

        fbw = jax.jit(value_and_grad)
        ops |= {"FBW": lambda: fbw(p, a, y)}
    return ops
