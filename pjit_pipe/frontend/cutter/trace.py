"""Run a Flax module's __call__ as one pipeline stage by intercepting its module calls.

The model's forward pass is a chain of *events*: calls of the modules one
level below the *containers* (`self.blocks[i](x, mask)`, the layers of
`nn.Sequential`, `self.embed.attend(h)`) and explicit `boundary(tree)`
markers, with arbitrary glue code between them. The root is a container; a
linen model whose repeated blocks sit deeper (`model.layers.N` in Hugging
Face's Llama, `transformer.h.N` in its GPT-2) has the modules on the way
down as containers too (`levels`, chosen by `nesting.py` from the call tree
a recording run keeps): a container's call runs as glue, and the events are
the calls inside it. A stage is the code between two events. To
run stage [start, stop) we run the whole `__call__` again, but calls before
`start` are skipped (they return stand-in values), the arrays an event
receives at `start` (every array in its arguments: its *activation*, a
pytree) are replaced by the stage input, and reaching event `stop` ends the
run with that event's activation. Later events of the stage that receive one
of the very arrays replaced at `start` (a mask passed to every block) get the
stage input's array instead. The glue that runs on stand-ins feeds nothing
the stage returns, so XLA removes it; the stage cutter checks that (see
`segments.py`), so a stage never silently reads a stand-in.

A child wrapped in a linen transform (nn.remat, nn.jit, nn.vmap) is entered
where the transform is applied, outside its trace: its activation is taken
and replaced there, and only the skipping happens inside.

A child wrapped in `nn.scan` (a stack of L layers with stacked parameters)
can also be cut between iterations. Its event is followed by L-1
*iteration* events (`layers[k]`: the stage begins before iteration k), whose
activation is the scan call's: the carry (its first argument) and the
broadcast arguments. A stage that runs iterations [a, b) of it enters the
scan call (with the stage input as its arguments when a > 0), and flax's
`lax.scan` runs only those iterations: every scanned input with L rows (the
parameters while cutting, the split rngs, scanned arguments) is cut to rows
[a, b), the stage's own parameters already hold just those rows. When b < L
the stage ends there, handing on (carry, broadcast arguments). A scan whose
per-iteration outputs (ys) are used, or that runs in reverse, is one event.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any

import flax.linen as nn
import jax

from pjit_pipe.errors import CutError
from pjit_pipe.frontend.cutter.events import Event
from pjit_pipe.frontend.cutter.linen_hooks import transforms_seen_from_outside
from pjit_pipe.frontend.cutter.nesting import CallTree, module_name


class _StageEnd(Exception):
    """Raised at the stage's last event to hand its activation back out of `apply`."""

    def __init__(self, act: Any):
        super().__init__()
        self.act = act


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def call_args(x: Any) -> tuple[tuple, dict]:
    """How a model input is passed to `__call__`: a dict as keyword arguments
    (`model(**x)`), anything else (an array, a tuple) as the one argument."""
    if isinstance(x, Mapping):
        return (), dict(x)
    return (x,), {}


class Run:
    """One pass over the model: records its events, or replays it as stage [start, stop).

    start=None: the stage begins at the model input. stop=None: it ends at the
    model output. act: the stage input (a tuple of arrays, the activation of
    event `start`). skips: stand-in outputs of the calls before `start`.
    """

    def __init__(
        self,
        start: int | None = None,
        stop: int | None = None,
        act: Any = None,
        skips: Mapping[int, Any] | None = None,
        expected: tuple[Event, ...] | None = None,
        levels: frozenset[tuple[str, ...]] = frozenset({()}),
    ):
        self.start, self.stop, self.act = start, stop, act
        self.levels = levels  # the containers' module paths (the root's is ())
        self.skips = skips or {}
        self.expected = expected
        # The event where the stage's input is swapped in: `start`, or the nn.scan
        # call when the stage begins between two of its iterations.
        self._first = start
        if expected is not None and start is not None and expected[start].kind == "iteration":
            self._first = start - expected[start].iteration
        self.events: list[Event] = []
        self._index = 0
        self._depth = 0
        # id(array replaced at `start`) -> (that array, the stage input's array)
        self._swapped: dict[int, tuple[Any, Any]] = {}
        # The transform (or class) name when the root's own __call__ is transformed.
        self.wrapped_root: str | None = None
        # A transformed child entered outside its transform:
        # (index, name, act avals, transform name, path). An nn.scan keeps it until its
        # lax.scan returns (flax traces the scan body twice).
        self._pending: tuple[int, str, Any, str, tuple[str, ...]] | None = None
        self._body_seen = False  # the pending scan's body was traced once already
        self._scan_args: tuple[tuple, dict] = ((), {})  # the pending scan call's arguments
        self._scanning = False  # inside the pending scan's lax.scan (nested ones run as is)
        # While recording: the module calls as a tree (see `CallTree`).
        self.calls = CallTree()
        self._open: list[tuple[str, ...]] = [()]  # the paths of the calls being run

    def is_event(self, path: tuple[str, ...]) -> bool:
        """Whether a call of the module at `path` is an event: its parent is a
        container and it is not one itself."""
        return bool(path) and path[:-1] in self.levels and path not in self.levels

    def intercept(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        """A linen method interceptor: the calls of modules below a container become
        events; while recording, every module call is noted in `calls`."""
        scope = context.module.scope
        if context.method_name == "setup" or scope is None or not scope.path:
            return next_fun(*args, **kwargs)
        path = tuple(map(str, scope.path))
        if self.expected is None:
            next_fun = self._noted(path, context.module, next_fun)
        if not self.is_event(path):
            return next_fun(*args, **kwargs)
        name = module_name(path)
        if self._pending is not None and not self._depth:
            return self._inner(name, next_fun, args, kwargs)
        if context.method_name != "__call__":
            name = f"{name}.{context.method_name}"
        return self.call(name, next_fun, args, kwargs, path)

    def _noted(self, path: tuple[str, ...], module: nn.Module, fn: Callable) -> Callable:
        """`fn`, noting its call in the call tree under the call that makes it."""

        def noted(*args: Any, **kwargs: Any) -> Any:
            self.calls.note(self._open[-1], path, module)
            self._open.append(path)
            try:
                return fn(*args, **kwargs)
            finally:
                self._open.pop()

        return noted

    def call(
        self,
        name: str,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        path: tuple[str, ...] | None = None,
    ) -> Any:
        """A call of an event's module, `fn(*args, **kwargs)`."""
        if self._depth:
            return fn(*args, **kwargs)
        i, act, args, kwargs = self._enter("call", name, args, kwargs)
        return self._finish(i, "call", name, act, lambda: fn(*args, **kwargs), path=path)

    def boundary(self, x: Any) -> Any:
        if self._depth:
            raise CutError(
                "pjit_pipe.boundary() must be called in the top-level module's __call__, "
                "not inside a submodule"
            )
        name = f"boundary#{self._index}"
        i, act, (x,), _ = self._enter("boundary", name, (x,), {})
        return self._finish(i, "boundary", name, act, lambda: x)

    def enter_transformed(
        self, path: tuple[str, ...], transform: str, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """An event's module wrapped in a linen transform, seen outside the transform:
        take its activation here; `intercept` finishes the event inside."""
        name = module_name(path)
        i, act, args, kwargs = self._enter("call", name, args, kwargs)
        self._pending = (i, name, act, transform, path)
        self._body_seen, self._scan_args = False, (args, kwargs)
        return args, kwargs

    def _inner(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        i, expected_name, act, transform, path = self._pending
        if transform != "Scan":
            self._pending = None
        if name != expected_name:
            raise RuntimeError(
                f"the transformed call {expected_name} ran module {name} inside its "
                "transform; pipelining needs one child module per transform"
            )
        run = lambda: fn(*args, **kwargs)  # noqa: E731
        record = not self._body_seen
        self._body_seen = True
        return self._finish(i, "call", expected_name, act, run, transform, record, path)

    def scan(self, lax_scan: Callable, body: Callable, init: Any, xs: Any, **kwargs: Any) -> Any:
        """flax's `lax.scan` of the pending nn.scan call: records its length, or runs
        only the stage's iterations of it (see the module doc)."""
        pending = self._pending
        if pending is None or pending[3] != "Scan" or self._scanning:
            return lax_scan(body, init, xs, **kwargs)
        i = pending[0]
        length = kwargs.get("length") or jax.tree.leaves(xs)[0].shape[0]
        first, stop = 0, length
        if self.expected is not None and self.expected[i].iterations:
            first = self.start - i if self._first == i and self.start != i else 0
            if self.stop is not None and i < self.stop < i + length:
                stop = self.stop - i
        if (first, stop) != (0, length):
            xs = jax.tree.map(lambda v: v[first:stop] if v.shape[0] == length else v, xs)
            kwargs = {**kwargs, "length": stop - first}
        self._scanning = True
        try:
            out = lax_scan(body, init, xs, **kwargs)
        finally:
            self._scanning, self._pending = False, None
        carry = out[0][1]  # flax's scan carry: (carried variables, the call's carry)
        if self.expected is None:
            ys = jax.tree.leaves(self.events[-1].out[1])
            cuttable = not ys and not kwargs.get("reverse")
            self.events[-1] = dataclasses.replace(
                self.events[-1], iterations=length if cuttable else None
            )
        elif stop < length:  # the stage ends between two iterations
            args, kwargs = self._scan_args
            leaves = jax.tree.leaves(((carry, *args[1:]), kwargs))
            raise _StageEnd(tuple(leaf for leaf in leaves if _is_array(leaf)))
        return out

    def _enter(self, kind: str, name: str, args: tuple, kwargs: dict):
        """Number the event; swap in the stage input at `start`, end the run at `stop`."""
        i = self._index
        self._index += 1
        if self.expected is not None and i < len(self.expected):
            self._index += (self.expected[i].iterations or 1) - 1  # its iteration events
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = [k for k, leaf in enumerate(leaves) if _is_array(leaf)]
        act = tuple(_aval(leaves[k]) for k in arrays) or None
        if self.expected is None:
            return i, act, args, kwargs
        if i >= len(self.expected) or self.expected[i].name != name:
            raise RuntimeError(
                f"the model's chain of top-level calls changed between traces at call {i} "
                f"({name}); pipelining needs the same calls in the same order every time"
            )
        for k in arrays:
            old = self._swapped.get(id(leaves[k]))
            if old is not None and old[0] is leaves[k]:
                leaves[k] = old[1]
        if i == self.stop:
            raise _StageEnd(tuple(leaves[k] for k in arrays))
        if i == self._first:
            for k, new in zip(arrays, self.act, strict=True):
                self._swapped[id(leaves[k])] = (leaves[k], new)
                leaves[k] = new
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        return i, act, args, kwargs

    def _finish(
        self,
        i: int,
        kind: str,
        name: str,
        act: Any,
        run: Callable[[], Any],
        transform: str | None = None,
        record: bool = True,
        path: tuple[str, ...] | None = None,
    ) -> Any:
        """Skip a call before `start` (stand-ins), or run it; record it when recording."""
        skipped = self.expected is not None and self._first is not None and i < self._first
        if skipped and kind == "call":
            return self.skips[i]
        self._depth += 1
        try:
            out = run()
        finally:
            self._depth -= 1
        if self.expected is None and record:
            out_avals = jax.tree.map(_aval, out)
            self.events.append(Event(kind, name, act, out_avals, transform, path=path))
        return out


_ACTIVE: ContextVar[Run | None] = ContextVar("pjit_pipe_active_run", default=None)


def boundary(x: Any) -> Any:
    """Mark a place in a module's `__call__` where the pipeline may cut.

    When a model contains markers, stages start only at markers. Outside a
    pipeline (plain `module.apply`) it does nothing.

    Args:
        x: What the previous stage hands to the next one: any pytree of arrays
            (a hidden state, `(hidden, mask)`, ...). Integer and boolean arrays
            cross too; they carry no gradient.

    Returns:
        `x` unchanged.

    Raises:
        CutError: It is called inside a submodule rather than in the top-level
            module's `__call__` (raised when the model is cut).
    """
    run = _ACTIVE.get()
    return x if run is None else run.boundary(x)


# One run traces at a time in a process. Failure variants compile on two threads
# (runtime/variants.py), and two cuts of a model with lifted transforms traced at
# once saw each other's modules (flax's and JAX's trace state is shared between
# threads). Tracing holds the GIL anyway; XLA's compile, the slow part, still
# runs in parallel.
_TRACE_LOCK = threading.RLock()


def drive(run: Run, forward: Callable[[], Any]) -> Any:
    """Run `forward()` (the model's whole forward pass, with its calls routed
    through `run`) and return the stage's output."""
    token = _ACTIVE.set(run)
    try:
        with _TRACE_LOCK:
            out = forward()
    except _StageEnd as end:
        return end.act
    finally:
        _ACTIVE.reset(token)
    if run.stop is not None:
        name = run.expected[run.stop].name if run.expected else run.stop
        raise RuntimeError(
            f"the stage should have ended at call {run.stop} ({name}) but the model "
            "returned: a Flax transform around the module's __call__ or around a group of "
            "its layers (nn.jit, nn.scan, nn.vmap of several layers) hides that call from "
            "the cutter; apply the transform to each layer instead, or cut at "
            "pjit_pipe.boundary() markers placed outside the transform"
        )
    return out


def run_module(
    module: nn.Module, variables: Any, x: Any, run: Run, method: Callable | None = None
) -> Any:
    """`module.apply(variables, x)` driven by `run`; returns the stage's output.
    `method`: the root's call to run instead of `__call__` (one under a transform
    that is seen through, `linen_hooks.seen_through_call`)."""
    args, kwargs = call_args(x)
    if method is not None:
        kwargs = {**kwargs, "method": method}

    def forward() -> Any:
        with nn.intercept_methods(run.intercept), transforms_seen_from_outside(run):
            return module.apply(variables, *args, **kwargs)

    return drive(run, forward)
