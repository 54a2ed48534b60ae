"""The cutter's hooks into linen's lifted transforms and nn.scan (frontend/cutter/trace.py).

Linen's lifted transforms (nn.remat, nn.jit, nn.vmap of a child) trace their
child in a scope of their own, where method interception does not see the
child's call; flax calls `get_module_scopes` first, with the child and its
arguments, so a hook there tells the run what enters the transform. flax's
nn.scan runs `jax.lax.scan` through `flax.core.axes_scan.lax`, so a stand-in
there lets the run cut the scan to its stage's iterations.

A root whose own `__call__` is decorated with nn.jit or nn.remat (gemma's
Transformer) would trace the whole forward pass inside that transform, where
a stage cannot end; neither changes what the call computes (the pipeline
compiles the whole step, and remats per stage by its own option), so the
cutter calls the method under the decorator instead (`seen_through_call`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import flax.core.axes_scan as axes_scan
import flax.linen as nn
import flax.linen.transforms as linen_transforms
import jax

if TYPE_CHECKING:
    from pjit_pipe.frontend.cutter.trace import Run


# Lifted transforms that change how a call is compiled or stored, not what it computes.
SEEN_THROUGH = ("jit", "checkpoint", "remat")


def seen_through_call(module: nn.Module) -> tuple[Callable[..., Any] | None, str | None]:
    """(the method under an nn.jit/nn.remat decorator on `module.__call__`, for
    `module.apply(..., method=)`; or None when there is none to see through, the
    transform's name); a decorator under another one is not seen through (the
    cutter then refuses the root by name)."""
    fn = type(module).__call__
    code = getattr(fn, "__code__", None)
    lifted = code is not None and code.co_filename == linen_transforms.__file__
    if not lifted or code.co_name != "wrapped_fn" or not hasattr(fn, "__wrapped__"):
        return None, None
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=False))
    transform = getattr(cells.get("transform"), "cell_contents", None)
    name = getattr(transform, "__name__", None)
    return (fn.__wrapped__ if name in SEEN_THROUGH else None), name


def _transform_name(module: nn.Module) -> str:
    """ "Checkpoint", "Jit", "Scan", ...: lifted classes are named transform + class
    ("CheckpointBlock"); a transformed method keeps its class's name."""
    base = type(module).__mro__[1].__name__
    return type(module).__name__.removesuffix(base) or type(module).__name__


# The run that linen's lifted transforms report to (`run_module`), per thread and
# context. The hooks that read it are installed once and for good and do nothing
# outside such a run: swapping flax's globals in and out per run raced when
# failure variants compile on several threads (runtime/variants.py), and could
# leave a finished run's hook in place, which then broke any later linen trace.
_LINEN_RUN: ContextVar[Run | None] = ContextVar("pjit_pipe_linen_run", default=None)
_install_lock = threading.Lock()
_flax_get_module_scopes: Callable[..., Any] | None = None


def _reported_module_scopes(module, args=None, kwargs=None):
    """flax's `get_module_scopes`, which its lifted transforms (nn.remat, nn.jit,
    nn.vmap of a child) call before entering their trace: inside a run it reports
    the child and its arguments to the run first."""
    run = _LINEN_RUN.get()
    if run is not None:
        scope = getattr(module, "scope", None)
        if scope is not None and not scope.path and run.wrapped_root is None:
            run.wrapped_root = _transform_name(module)
        path = tuple(map(str, scope.path)) if scope is not None else ()
        if not run._depth and run._pending is None and run.is_event(path) and args is not None:
            args, kwargs = run.enter_transformed(
                path, _transform_name(module), tuple(args), dict(kwargs or {})
            )
    return _flax_get_module_scopes(module, args, kwargs)


class _LaxSeenByRuns:
    """`jax.lax` for flax's nn.scan: inside a run its `scan` goes through the run
    (which may cut it to the stage's iterations)."""

    def scan(self, body: Callable, init: Any, xs: Any, **kwargs: Any) -> Any:
        run = _LINEN_RUN.get()
        if run is None:
            return jax.lax.scan(body, init, xs, **kwargs)
        return run.scan(jax.lax.scan, body, init, xs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(jax.lax, name)


def _install_linen_hooks() -> None:
    global _flax_get_module_scopes
    with _install_lock:
        if _flax_get_module_scopes is None:
            _flax_get_module_scopes = linen_transforms.get_module_scopes
            linen_transforms.get_module_scopes = _reported_module_scopes
            axes_scan.lax = _LaxSeenByRuns()


@contextlib.contextmanager
def transforms_seen_from_outside(run: Run) -> Iterator[None]:
    """While running, linen's lifted transforms (nn.remat, nn.jit, nn.vmap of a
    child) report the child and its arguments to `run` before entering their trace,
    and flax's nn.scan runs through it."""
    _install_linen_hooks()
    token = _LINEN_RUN.set(run)
    try:
        yield
    finally:
        _LINEN_RUN.reset(token)
