"""`ProgramCache`: a pipeline's compiled programs, bounded, least recently used first out.

A program is compiled per (loss function object, shapes, rng streams): JAX
cannot tell that two lambdas compute the same loss, so a loss built anew on
each call (a lambda or functools.partial inside the training loop) compiles
the whole pipeline again every time, seconds instead of milliseconds. The
cache notices that case (a miss whose key differs from a cached one only in
the loss function object) and warns, and its bound keeps such a loop from
holding every program it ever compiled.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class ProgramKey(NamedTuple):
    """What a compiled program depends on: the loss function object (or the name of
    a loss-free program such as "forward") and everything else (cut, shapes, rngs)."""

    loss_fn: Hashable
    rest: Hashable


class ProgramCache(Generic[T]):
    """Up to `size` compiled programs; a new one beyond that drops the least recently used."""

    def __init__(self, size: int):
        self.size = size
        self._programs: OrderedDict[ProgramKey, T] = OrderedDict()

    def __len__(self) -> int:
        return len(self._programs)

    def __contains__(self, key: ProgramKey) -> bool:
        return key in self._programs

    def get(self, key: ProgramKey, build: Callable[[], T]) -> T:
        """The program for `key`, built (and cached) with `build()` on a miss."""
        if key in self._programs:
            self._programs.move_to_end(key)
            return self._programs[key]
        if callable(key.loss_fn) and any(
            k.rest == key.rest and callable(k.loss_fn) and k.loss_fn != key.loss_fn
            for k in self._programs
        ):
            warnings.warn(
                f"pipeline: compiling again for a new loss function object "
                f"({_name(key.loss_fn)}) with the same shapes as a compiled one; programs are "
                "cached per loss function object, so define the loss once and reuse it "
                "(not a new lambda or functools.partial on each step)",
                stacklevel=4,
            )
        program = build()
        self._programs[key] = program
        while len(self._programs) > self.size:
            self._programs.popitem(last=False)
        return program


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


__all__ = ["ProgramCache", "ProgramKey"]
