"""Run a Flax module's __call__ as one pipeline stage by intercepting its top-level calls.

The model's forward pass is a chain of *events*: calls of the root module's
direct children (`self.blocks[i](x)`, the layers of `nn.Sequential`) and
explicit `boundary(x)` markers, with arbitrary glue code between them. A stage
is the code between two events. To run stage [start, stop) we run the whole
`__call__` again, but calls before `start` are skipped (they return stand-in
values), the activation of event `start` is replaced by the stage input, and
reaching event `stop` ends the run with that event's activation. The glue that
runs on stand-ins feeds nothing the stage returns, so XLA removes it; the stage
cutter checks that (see `cut.py`), so a stage never silently reads a stand-in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax


@dataclass(frozen=True)
class Event:
    """One top-level call or boundary marker, as seen when the model was recorded.

    act: shape of the activation (the first positional argument) when it is a
        single array, else None (such an event cannot start a stage).
    out: shapes of what the event returned (a call is skipped by returning
        stand-ins of these shapes).
    """

    kind: str  # "call" or "boundary"
    name: str
    act: jax.ShapeDtypeStruct | None
    out: Any


class _StageEnd(Exception):
    """Raised at the stage's last event to hand its activation back out of `apply`."""

    def __init__(self, act: Any):
        super().__init__()
        self.act = act


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


class Run:
    """One pass over the model: records its events, or replays it as stage [start, stop).

    start=None: the stage begins at the model input. stop=None: it ends at the
    model output. skips: stand-in outputs of the calls before `start`.
    """

    def __init__(
        self,
        start: int | None = None,
        stop: int | None = None,
        act: Any = None,
        skips: Mapping[int, Any] | None = None,
        expected: tuple[Event, ...] | None = None,
    ):
        self.start, self.stop, self.act = start, stop, act
        self.skips = skips or {}
        self.expected = expected
        self.events: list[Event] = []
        self._index = 0
        self._depth = 0

    def intercept(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        """A linen method interceptor: top-level submodule calls become events."""
        scope = context.module.scope
        top = context.method_name != "setup" and scope is not None and len(scope.path) == 1
        if not top:
            return next_fun(*args, **kwargs)
        return self.call(context.module.name, next_fun, args, kwargs)

    def call(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A call of one of the root module's children, `fn(*args, **kwargs)`."""

        def run(call_args: tuple) -> Any:
            self._depth += 1
            try:
                return fn(*call_args, **kwargs)
            finally:
                self._depth -= 1

        if self._depth:
            return run(args)
        return self._event("call", name, args, run)

    def boundary(self, x: Any) -> Any:
        if self._depth:
            raise ValueError(
                "pjit_pipe.boundary() must be called in the top-level module's __call__, "
                "not inside a submodule"
            )
        return self._event("boundary", f"boundary#{self._index}", (x,), lambda a: a[0])

    def _event(self, kind: str, name: str, args: tuple, run: Callable[[tuple], Any]) -> Any:
        i = self._index
        self._index += 1
        if self.expected is None:
            out = run(args)
            act = _aval(args[0]) if args and _is_array(args[0]) else None
            self.events.append(Event(kind, name, act, jax.tree.map(_aval, out)))
            return out
        if i >= len(self.expected) or self.expected[i].name != name:
            raise RuntimeError(
                f"the model's chain of top-level calls changed between traces at call {i} "
                f"({name}); pipelining needs the same calls in the same order every time"
            )
        if i == self.stop:
            raise _StageEnd(args[0])
        if self.start is not None:
            if i < self.start:
                return self.skips[i] if kind == "call" else args[0]
            if i == self.start:
                args = (self.act, *args[1:])
        return run(args)


_ACTIVE: ContextVar[Run | None] = ContextVar("pjit_pipe_active_run", default=None)


def boundary(x: Any) -> Any:
    """Mark a place in a module's `__call__` where the pipeline may cut.

    Returns `x` unchanged. When a model contains markers, stages start only at
    markers; `x` (one array) is what the previous stage hands to the next one.
    """
    run = _ACTIVE.get()
    return x if run is None else run.boundary(x)


def drive(run: Run, forward: Callable[[], Any]) -> Any:
    """Run `forward()` (the model's whole forward pass, with its calls routed
    through `run`) and return the stage's output."""
    token = _ACTIVE.set(run)
    try:
        out = forward()
    except _StageEnd as end:
        return end.act
    finally:
        _ACTIVE.reset(token)
    if run.stop is not None:
        raise RuntimeError(f"the stage should have ended at call {run.stop} but the model returned")
    return out


def run_module(module: nn.Module, variables: Any, x: Any, run: Run) -> Any:
    """`module.apply(variables, x)` driven by `run`; returns the stage's output."""

    def forward() -> Any:
        with nn.intercept_methods(run.intercept):
            return module.apply(variables, x)

    return drive(run, forward)
