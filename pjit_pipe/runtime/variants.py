"""Compiled training steps for failure and slow-worker patterns, prepared before they are needed.

Each set of failed workers is its own program: its own re-routed schedule and
its own executable over the surviving devices (patterns equal up to a
replica permutation share the schedule search, not the executable, since the
devices differ). `Variants` compiles them ahead of time (`lower().compile()`)
in a background thread while training runs, fault-free first, then every
pattern of up to `max_failures` failed workers; one that was not foreseen
compiles on demand. With `cache_dir`, JAX's persistent compilation cache keeps
the executables on disk, so a restarted job loads instead of compiling.

A pattern with slow workers (runtime/speed.py) runs the mitigated program of
its canonical form (`FailurePattern.canonical` with the factors) on the mesh
with its replica rows reordered to match (`reorder_replicas`): worker 1:2 slow
runs the program of worker 0:2 slow, with replica 1's devices as row 0. All
devices are live and replicas hold the same stage parameters, so the state
stays where it is, and the lowered program is the same text for every
replica permutation. An executable is bound to its devices' order, so on
CPU each permutation still compiles; on GPU JAX's persistent cache leaves
that order out of its key, so a permutation finds the executable compiled
first.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax

from pjit_pipe.errors import OptionError
from pjit_pipe.frontend import Pipelined, TrainState, TrainStep, reorder_replicas
from pjit_pipe.ir.failures import FailurePattern, enumerate_patterns, inverse
from pjit_pipe.ir.ops import Worker

DownWorkers = frozenset[Worker]  # the failed workers a variant is compiled for
SlowWorkers = tuple[tuple[Worker, float], ...]  # slow workers' factors > 1, sorted by worker
VariantKey = tuple[DownWorkers, SlowWorkers]  # what a variant is compiled for
COMPILE_THREADS = 2  # concurrent variant compiles: tracing holds the GIL, XLA does not


def compile_threads(background: bool) -> int:
    """How many variants compile at once: COMPILE_THREADS, but in the background
    no more than leaves one core to the training steps running meanwhile (on a
    2-core machine a second compile thread slows the steps more than it gains)."""
    if not background:
        return COMPILE_THREADS
    return max(1, min(COMPILE_THREADS, (os.cpu_count() or 1) - 1))


@dataclass(frozen=True)
class Variant:
    """The training step for one set of failed workers and of slow workers.

    `pipelined` runs on the deployment's devices; with slow workers its mesh
    may list the replicas in another order (module docstring)."""

    failed: DownWorkers
    pipelined: Pipelined
    step: TrainStep
    compile_seconds: float
    slow: SlowWorkers = ()

    def __call__(self, state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, Any]:
        return self.step(state, batch)


def check_cache_dir(cache_dir: str | os.PathLike) -> None:
    """Refuse a cache folder that names a file: JAX would only warn, and cache
    nothing, on every compile.

    Args:
        cache_dir: the folder for JAX's persistent compilation cache.

    Raises:
        OptionError: `cache_dir` names a file.
    """
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise OptionError(
            f"cache_dir (--cache-dir): {cache_dir} is a file, not a directory; give a "
            "directory path (it is created if missing)"
        )


def use_disk_cache(cache_dir: str | os.PathLike) -> None:
    """Keep every compiled executable in JAX's persistent cache under `cache_dir`,
    however quick its compile or small its entry (JAX keeps only compiles over one
    second by default; a pipeline's small programs add up to several).

    JAX opens the folder at its first compile in the process: call this before
    anything compiles for every program to be kept.

    Args:
        cache_dir: the folder (created if missing).

    Raises:
        OptionError: `cache_dir` names a file.
    """
    check_cache_dir(cache_dir)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no floor, fixed


class Variants:
    """Compiled steps per failure set and slow workers: `get(failed, slow)` returns
    one, compiling if needed.

    `example_state` and `example_batch` fix the shapes (a TrainState from
    `pipelined.train_step(loss_fn).init` and one (x, y) batch).
    """

    def __init__(
        self,
        pipelined: Pipelined,
        loss_fn: Callable,
        example_state: TrainState,
        example_batch: tuple[Any, Any],
        cache_dir: str | None = None,
    ):
        if cache_dir is not None:
            use_disk_cache(cache_dir)
        self.base = pipelined
        self.loss_fn = loss_fn
        self.example = (example_state, example_batch)
        self._lock = threading.Lock()
        self._futures: dict[VariantKey, Future] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def get(
        self,
        failed: Iterable[tuple[int, int]] = (),
        slow: Mapping[tuple[int, int], float] | None = None,
    ) -> Variant:
        """The variant for these failed and slow workers (waits if it is being compiled).

        Args:
            failed: The (replica, stage) workers down.
            slow: {(replica, stage): factor}; factors of 1 are full speed.

        Returns:
            The compiled Variant.

        Raises:
            ScheduleError: a stage has no survivor (naming it).
            FailurePlanError: a slow worker that is failed or outside the mesh,
                or a factor below 1.
        """
        key = self._key(failed, slow)
        future, mine = self._claim(key)
        if mine:
            self._build(key, future)
        return future.result()

    def ready(
        self,
        failed: Iterable[tuple[int, int]] = (),
        slow: Mapping[tuple[int, int], float] | None = None,
    ) -> bool:
        """Whether the variant is compiled (get would not wait).

        Args:
            failed: The (replica, stage) workers down.
            slow: {(replica, stage): factor}.

        Returns:
            True when `get(failed, slow)` returns at once.
        """
        future = self._futures.get(self._key(failed, slow, check=False))
        return future is not None and future.done()

    def _key(
        self,
        failed: Iterable[tuple[int, int]],
        slow: Mapping[tuple[int, int], float] | None,
        check: bool = True,
    ) -> VariantKey:
        down = frozenset(Worker(*w) for w in failed)
        if check:
            FailurePattern(self.base.replicas, self.base.stages, down)  # raises if unrecoverable
        speeds = sorted((Worker(*w), float(f)) for w, f in (slow or {}).items() if f != 1.0)
        return down, tuple(speeds)

    def precompile(
        self,
        max_failures: int = 1,
        background: bool = True,
        on_done: Callable[[Variant], None] | None = None,
        first: Iterable[Iterable[tuple[int, int]]] = (),
        slow_first: Iterable[Mapping[tuple[int, int], float]] = (),
        slow_factors: Iterable[float] = (),
    ) -> None:
        """Compile the fault-free step and every recoverable pattern of up to
        `max_failures` failed workers, then each single slow worker at each of
        `slow_factors` (nobody failed), in a daemon thread unless `background`
        is False. `on_done(variant)` is called after each one this call compiles.
        The failure sets in `first` and the slow workers in `slow_first` (those
        a plan will need, nobody failed) go before the others, whatever their size."""
        patterns = enumerate_patterns(
            self.base.replicas, self.base.stages, max_failures, canonical=False
        )
        singles = [
            {(r, s): f}
            for f in slow_factors
            for r in range(self.base.replicas)
            for s in range(self.base.stages)
        ]
        keys = [
            *(self._key(f, None) for f in first),
            *(self._key((), speeds) for speeds in slow_first),
            *(self._key(p.failed, None) for p in patterns),
            *(self._key((), speeds) for speeds in singles),
        ]
        keys = list(dict.fromkeys(keys))  # once each

        def compile_one(key: VariantKey) -> None:
            if self._stop.is_set():
                return
            future, mine = self._claim(key)
            if mine:
                self._build(key, future)
                if on_done is not None and future.exception() is None:
                    on_done(future.result())

        def work() -> None:
            # XLA compiles outside the GIL, so two compiles overlap one's tracing
            # with the other's codegen.
            with ThreadPoolExecutor(compile_threads(background), "pjit_pipe-compile") as pool:
                list(pool.map(compile_one, keys))

        if not background:
            work()
            return
        self._thread = threading.Thread(target=work, name="pjit_pipe-precompile", daemon=True)
        self._thread.start()
        # A daemon thread killed inside XLA's compiler aborts the interpreter at
        # exit: let it finish the variant in progress first.
        atexit.register(self.close)

    def wait(self) -> None:
        """Block until the background precompilation has finished."""
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stop precompiling after the variant in progress."""
        self._stop.set()
        self.wait()

    @property
    def compiled(self) -> dict[DownWorkers, Variant]:
        """The variants compiled so far with every worker at full speed, by failure set."""
        return {failed: v for (failed, slow), v in self._done().items() if not slow}

    @property
    def mitigated(self) -> dict[VariantKey, Variant]:
        """The variants with slow workers compiled so far, by (failed, slow factors)."""
        return {key: v for key, v in self._done().items() if key[1]}

    def _done(self) -> dict[VariantKey, Variant]:
        with self._lock:
            done = dict(self._futures)
        return {k: f.result() for k, f in done.items() if f.done() and f.exception() is None}

    def _claim(self, key: VariantKey) -> tuple[Future, bool]:
        with self._lock:
            if key in self._futures:
                return self._futures[key], False
            future: Future = Future()
            self._futures[key] = future
            return future, True

    def _build(self, key: VariantKey, future: Future) -> None:
        failed, slow = key
        try:
            if slow:
                pv = self._relabelled(failed, slow)
            else:
                pv = self.base.with_failures(sorted(failed)) if failed else self.base
            # Not donated: a failed attempt is retried from the state it was given.
            step = pv.train_step(self.loss_fn, donate=False)
            seconds = step.compile(*self.example)
            future.set_result(Variant(failed, pv, step, seconds, slow))
        except BaseException as e:  # the waiter re-raises it
            with self._lock:
                del self._futures[key]  # a later get may try again
            future.set_exception(e)

    def _relabelled(self, failed: DownWorkers, slow: SlowWorkers) -> Pipelined:
        """The mitigated pipeline of the canonical form of (failed, slow), on the
        mesh whose replica rows are reordered so that it runs this pattern."""
        base = self.base
        pattern, perm = FailurePattern(base.replicas, base.stages, failed).canonical(dict(slow))
        mesh = reorder_replicas(base.mesh, inverse(perm))  # row perm[r] holds replica r
        options = dataclasses.replace(base.options, mesh=mesh)
        pv = Pipelined(base.module, options, cuts=base.cuts)  # the same stage cuts
        if pattern.failed:
            pv = pv.with_failures(sorted(pattern.failed))
        return pv.with_slow({(perm[w.replica], w.stage): f for w, f in slow})
