"""Training that goes on through device failures.

Each step is an attempt inside the detector's context: the detector says which
workers are down, the matching variant runs (switching programs costs a
dictionary lookup when it was precompiled), and its result is committed only
if no worker died meanwhile. Otherwise the step is retried on the new variant
from the last committed state, so no microbatch is lost and no update applied
twice. The state is sharded by stage (frontend/state.py): on a switch the
survivors keep their own rows, nothing is read from a failed device, and when
a worker is back the fault-free program runs again after the rejoined device
copies its stage's parameters and optimizer state from a live peer. Each
switch event records the bytes that moved.

With a speed monitor (runtime/speed.py), a step also runs the program for
the workers that are slow: part of their microbatches move to peers of their
stage (`Pipelined.with_slow`), and the fault-free program again once they
recover; the numbers do not change. These programs compile in the background
too: the slow workers an `InjectedSlowdowns` plan goes through first, then
every single slow worker at each of `slow_factors`; replica permutations of
one pattern run one program on reordered replicas (runtime/variants.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from pjit_pipe.errors import StateError
from pjit_pipe.frontend import Pipelined, TrainState, worker_devices
from pjit_pipe.ir.ops import Worker
from pjit_pipe.ir.slow import check_factor
from pjit_pipe.runtime.detector import (
    CollectiveTimeout,
    FailureDetector,
    InjectedFailures,
    LiveDevices,
    WorkerFailure,
)
from pjit_pipe.runtime.speed import InjectedSlowdowns, SpeedMonitor, Speeds
from pjit_pipe.runtime.variants import Variant, Variants, check_cache_dir


@dataclass(frozen=True)
class TrainerEvent:
    """Something the runtime did: 'failure' (an attempt lost), 'wait' (the
    program for the workers down and slow is not compiled yet: the step waits
    for it), 'switch' (another program; its seconds include any wait),
    'skipped' (a step whose loss or gradient norm was not finite left the
    state as it was)."""

    step: int
    kind: str
    failed: frozenset[Worker]
    seconds: float = 0.0
    bytes_moved: int = 0  # state bytes copied between devices by a switch
    slow: tuple[tuple[Worker, float], ...] = ()  # slow workers' factors of the program

    def describe(self) -> str:
        down = ", ".join(map(str, sorted(self.failed))) or "none"
        if self.slow:
            down += "; slow = " + ", ".join(f"{w} x{f:g}" for w, f in self.slow)
        if self.kind == "failure":
            return f"step {self.step}: worker(s) {down} failed; retrying the step"
        if self.kind == "wait":
            return (
                f"step {self.step}: the program for failed = {down} is not compiled yet; "
                "waiting for it"
            )
        if self.kind == "skipped":
            return (
                f"step {self.step}: the loss or the global gradient norm is not finite; "
                "the update was skipped (parameters and optimizer state unchanged)"
            )
        return (
            f"step {self.step}: switched to the program for failed = {down} in "
            f"{self.seconds * 1e3:.0f} ms, moving {self.bytes_moved} bytes of state"
        )


class ResilientTrainer:
    """`state, loss = trainer.step(state, batch)`, through failures and rejoins.

    Each step runs the program of the workers that are down (see the module
    docstring) and is retried on the new one when a worker dies during it. An
    `InjectedFailures` plan is checked here, before anything compiles. A step
    skipped as not finite (see TrainStep) is recorded as a 'skipped' event.

    Args:
        pipelined: The fault-free pipeline; it needs an optimizer.
        loss_fn: The loss function, as `Pipelined.train_step` takes it.
        detector: Where failures come from (default: `LiveDevices` on a job of
            several processes, else `InjectedFailures()`, none).
        max_failures: Failure patterns of up to this many workers are compiled
            ahead, in the background.
        cache_dir: A directory for the on-disk cache of executables, or None.
        on_event: Called with each TrainerEvent as it is recorded.
        speeds: Where slow workers come from (runtime/speed.py), or None: every
            worker at full speed.
        slow_factors: With `speeds`, every single slow worker at each of these
            factors is compiled ahead, in the background, after the slow
            workers an `InjectedSlowdowns` plan goes through. The default,
            factor 2 alone, is D x P programs; `FACTORS[1:]` covers every
            factor the detector marks (4 D x P programs), () none.

    Attributes:
        events: Every TrainerEvent so far ('failure', 'wait', 'switch', 'skipped').
        variants: The compiled programs per failure and slow-worker pattern;
            None until `init`.

    Raises:
        OptionError: `cache_dir` names a file.
        FailurePlanError: An `InjectedFailures` plan cannot run on the
            pipeline's mesh, or a factor of `slow_factors` is below 1.
    """

    def __init__(
        self,
        pipelined: Pipelined,
        loss_fn: Callable,
        detector: FailureDetector | None = None,
        max_failures: int = 1,
        cache_dir: str | None = None,
        on_event: Callable[[TrainerEvent], None] | None = None,
        speeds: SpeedMonitor | None = None,
        slow_factors: tuple[float, ...] = (2.0,),
    ):
        self.slow_factors = tuple(
            check_factor(f, "a single slow worker", "slow_factors") for f in slow_factors
        )
        if cache_dir is not None:
            check_cache_dir(cache_dir)
        if detector is None:
            several = jax.process_count() > 1
            detector = LiveDevices(pipelined.mesh) if several else InjectedFailures()
        self.detector = detector
        if isinstance(self.detector, InjectedFailures):
            self.detector.check(pipelined.replicas, pipelined.stages)
        self.pipelined = pipelined
        self.loss_fn = loss_fn
        self.max_failures = max_failures
        self.cache_dir = cache_dir
        self.on_event = on_event
        self.events: list[TrainerEvent] = []
        self.variants: Variants | None = None
        self._current: frozenset[Worker] = frozenset()
        self.speeds = speeds
        self._slow: Speeds = {}  # the slow workers of the program that ran last

    def init(
        self,
        params: Any,
        batch: tuple[Any, Any],
        precompile: bool = True,
        background: bool = True,
        on_compiled: Callable[[Variant], None] | None = None,
    ) -> TrainState:
        """The initial state, after compiling the fault-free step.

        Then, with `precompile`, compiles every pattern of up to `max_failures`
        failed workers, so a switch later costs a dictionary lookup; the
        patterns an `InjectedFailures` plan goes through compile first. With a
        speed monitor, the slow workers an `InjectedSlowdowns` plan goes
        through follow them, and every single slow worker at `slow_factors`
        comes last. With `LiveDevices` (a job of several processes), the
        programs for each other process's death compile before this returns,
        whatever `precompile` says, and the processes leave together.

        Args:
            params: Module-layout parameters, or a TrainState (e.g. a restored
                checkpoint), which is moved into the fault-free layout.
            batch: An example batch (x, y); it fixes the stage cut and shapes.
            precompile: Compile the failure and slow-worker patterns ahead.
            background: Compile them in a background thread (else before
                returning).
            on_compiled: Called with each variant once it is compiled.

        Returns:
            The TrainState in the fault-free pipeline's device layout.

        Raises:
            OptimizerError: The pipeline has no optimizer.
            LossFnError: `loss_fn` cannot be called as loss_fn(outputs, y).
            StateError: `params` is a TrainState of another model or optimizer,
                or one a donating step consumed.
            BatchError: `batch` is not the pair (x, y) or does not fit the
                pipeline.
        """
        step = self.pipelined.train_step(self.loss_fn, donate=False)
        if isinstance(params, TrainState):
            state, _ = step.adopt(params, batch)
        else:
            state = step.init(params, batch)
        self.variants = Variants(self.pipelined, self.loss_fn, state, batch, self.cache_dir)
        self.variants.get(())
        if isinstance(self.detector, LiveDevices):
            # Every process compiles the programs of the other processes' deaths
            # before the first step, then they start together: a survivor that
            # compiled its switch later than the collective timeout would break
            # the step for all.
            needed = self.detector.planned(jax.process_index())
            self.variants.precompile(0, background=False, first=needed)
            self.detector.sync()
        if precompile:
            planned = self.detector.planned() if isinstance(self.detector, InjectedFailures) else []
            slow_planned = (
                self.speeds.planned() if isinstance(self.speeds, InjectedSlowdowns) else []
            )
            self.variants.precompile(
                self.max_failures,
                background,
                on_compiled,
                first=planned,
                slow_first=slow_planned,
                slow_factors=self.slow_factors if self.speeds is not None else (),
            )
        return state

    def step(self, state: TrainState, batch: tuple[Any, Any]) -> tuple[TrainState, jax.Array]:
        """One committed optimizer step: retried until an attempt finishes with no failure.

        A failed attempt's results are thrown away and the step runs again from
        `state` on the program for the workers now down, so no microbatch is
        lost and no update applied twice.

        Args:
            state: The last committed state.
            batch: The step's batch (x, y).

        Returns:
            (new state, loss) of the committed attempt.

        Raises:
            StateError: `init` was not called first.
        """
        if self.variants is None:
            raise StateError("ResilientTrainer.step: call init(params, batch) first")
        slow = self.speeds.observe(state.step) if self.speeds is not None else {}
        while True:
            try:
                with self.detector.attempt(state.step) as down:
                    variant, state = self._switch(state, down, batch, slow)
                    new_state, loss = variant(state, batch)
                    jax.block_until_ready(loss)
            except CollectiveTimeout:
                raise  # nothing is down: the same program would fail again
            except WorkerFailure as failure:
                self._record(TrainerEvent(failure.step, "failure", failure.workers))
                continue
            if new_state.skipped > state.skipped:
                self._record(TrainerEvent(state.step, "skipped", self._current))
            return new_state, loss

    def _switch(
        self, state: TrainState, down: frozenset[Worker], batch: tuple[Any, Any], slow: Speeds
    ) -> tuple[Variant, TrainState]:
        """The variant for `down` and the `slow` workers, and the state moved into
        its layout (the devices of the down workers are never read)."""
        start = time.perf_counter()
        slow = {w: f for w, f in slow.items() if w not in down}
        if not self.variants.ready(down, slow):
            self._record(TrainerEvent(state.step, "wait", down, slow=tuple(sorted(slow.items()))))
        variant = self.variants.get(down, slow)
        mesh = self.pipelined.mesh
        unavailable = {d for w in down for d in worker_devices(mesh)[w.replica, w.stage]}
        state, moved = variant.step.adopt(state, batch, unavailable)
        if down != self._current or slow != self._slow:
            if isinstance(self.detector, LiveDevices):
                self.detector.sync()  # survivors start the new program together
            self._current, self._slow = down, slow
            seconds = time.perf_counter() - start
            factors = tuple(sorted(slow.items()))
            self._record(TrainerEvent(state.step, "switch", down, seconds, moved, factors))
        return variant, state

    @property
    def slow(self) -> Speeds:
        """The slow workers of the last committed step's program.

        Returns:
            {Worker: factor > 1}.
        """
        return dict(self._slow)

    @property
    def down(self) -> frozenset[Worker]:
        """The workers that were down during the last committed step.

        Returns:
            Those workers, as (replica, stage) Workers.
        """
        return self._current

    def _record(self, event: TrainerEvent) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def close(self) -> None:
        """Stop background compilation."""
        if self.variants is not None:
            self.variants.close()
