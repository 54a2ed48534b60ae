"""The tick program with its compute replaced by host callbacks: an emulated run.

`lower(..., emulate=host)` compiles the same tick table, tick body and
message ppermutes as for a model, with three hooks:

- every op function (tick_ops.py) becomes a stub: a host callback
  (`host.run(device, kind, stage)`) whose result is folded into zeros of the
  shapes the real op returns (the residual stores an F or B writes into pass
  through unwritten), so nothing is computed but the stores, the
  conditionals and the messages are the real program's;
- at the start of each tick, once the message rows its lanes read are
  gathered (and a deferred plan's late messages have arrived),
  `host.start(device)`; every lane reads through its result;
- at the end of each tick, after the last lane and before the ppermutes,
  `host.end(device)`: the messages the tick sends carry its result.

The callbacks run in that order on each device because each one's operands
depend on the one before (the lanes' conditionals already chain through the
residual stores and the gradient message, tick.py). `host` decides what each
callback does: runtime/emulation.py sleeps each op's price and the transfer
time where the price puts it. A sleeping callback uses no CPU, so a few cores
time many emulated devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback

from pjit_pipe.ir.ops import Kind
from pjit_pipe.lowering.compute.stages import Residuals
from pjit_pipe.lowering.tick_plan import FUSED, BranchKind

# The code of each branch kind a callback names (plan.KIND_ORDER's kinds).
KIND_CODES: dict[BranchKind, int] = {Kind.F: 0, Kind.B: 1, Kind.W: 2, Kind.BW: 3, FUSED: 4}

_TOKEN = jax.ShapeDtypeStruct((), jnp.float32)


class EmulationHost(Protocol):
    """What the host side of an emulated run answers; each returns 0.0 (float32)."""

    def start(self, device: Any, dep: Any) -> Any: ...

    def run(self, device: Any, dep: Any, *, kind: int, stage: int) -> Any: ...

    def end(self, device: Any, dep: Any) -> Any: ...


def _dependency(tree: Any) -> jax.Array:
    """A float32 scalar that depends on every array leaf of `tree` (one element each):
    a callback that takes it runs after whatever made them."""
    leaves = [jnp.ravel(a)[:1].astype(jnp.float32) for a in jax.tree.leaves(tree) if jnp.size(a)]
    return jnp.sum(jnp.concatenate(leaves)) if leaves else jnp.float32(0)


def _zeros(aval: Any) -> jax.Array:
    return jnp.zeros(aval.shape, aval.dtype)


def _carrying(tree: Any, token: jax.Array) -> Any:
    """`tree` with `token` (0.0 from a callback) added to each array leaf: whatever
    reads it runs after the callback."""
    return jax.tree.map(lambda a: a + token.astype(jnp.result_type(a)), tree)


class EmulatedTicks:
    """The emulation hooks of one tick program (module docstring); `axes`: the mesh
    axes whose linear index is a device's row (lowering/comms/topology.py)."""

    def __init__(self, host: EmulationHost, axes: tuple[str, ...]):
        self.host, self.axes = host, axes

    def _call(self, fn: Callable, dep: Any) -> jax.Array:
        return io_callback(fn, _TOKEN, lax.axis_index(self.axes), _dependency(dep))

    def op(self, kind: BranchKind, stage: int, run: Callable) -> Callable:
        """The stub of op function `run` of (kind, virtual stage)."""
        host_run = functools.partial(self.host.run, kind=KIND_CODES[kind], stage=stage)

        def stub(params, x, y, inbox, res, row):
            shapes = jax.eval_shape(run, params, x, y, inbox, res, row)
            token = self._call(host_run, (inbox, res, row))
            # An F or B returns the residual stores it writes into: they pass through.
            outs = [
                res if isinstance(out, Residuals) else jax.tree.map(_zeros, out) for out in shapes
            ]
            return _carrying(tuple(outs), token)

        return stub

    def tick_start(self, rows: Any) -> Any:
        """The message rows the tick's lanes read, after `host.start`."""
        return _carrying(rows, self._call(self.host.start, rows))

    def tick_end(self, sent: Any, done: Any) -> Any:
        """The messages the tick sends (`sent`), after `host.end`, which follows
        everything in `done` (the lanes' outputs)."""
        return _carrying(sent, self._call(self.host.end, (sent, done)))
