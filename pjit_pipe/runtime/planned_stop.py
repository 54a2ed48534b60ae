"""A step at which every live process of a job stops together, agreed with no barrier.

A job of several processes restarts as a whole to make its mesh whole again
(`pjit-pipe train --processes N --restart`): the survivors of a death save a
checkpoint at one step and leave, and the launcher starts every process again
from it. They must all stop at the same step: a process that stops while the
others enter the next step's collectives leaves them waiting for it until
the collective timeout.

The request arrives at some processes, at some moment (a line on stdin from
the launcher). A process that has it proposes, before it starts step s, to
stop before step s + 2, in the coordination service's key-value store; the
first proposal stands (the store refuses to overwrite a key), and every
process reads the agreed step before each step. The steps of a job run in
lockstep (each needs every process's part of its collectives), so no other
process can have begun step s + 1 before the proposal was written: it would
have needed the proposer's part of step s. Every process therefore reads the
agreed step in time, and all of them stop before the same one.
"""

from __future__ import annotations

import threading

STOP_KEY = "pjit_pipe/stop_before_step"  # the agreed step, in the job's key-value store
LEAD = 2  # a proposal made before step s stops the job before step s + LEAD


class PlannedStop:
    """Whether to stop before a step, once a stop was requested anywhere in the job.

    Call `request()` from any thread when this process is asked to stop, and
    `should_stop(step)` before each step, on every process of the job.
    """

    def __init__(self):
        self._requested = threading.Event()
        self.agreed: int | None = None  # the step the job stops before, once known

    def request(self) -> None:
        """Ask the job to stop soon (this process proposes a step before its next)."""
        self._requested.set()

    def should_stop(self, step: int) -> bool:
        """Whether to stop before `step` (True from the agreed step on).

        Args:
            step: The step this process is about to run.

        Returns:
            Whether the job stops here: every process gets True at the same step.
        """
        import jax
        from jax._src import distributed

        client = distributed.global_state.client
        if self.agreed is None and self._requested.is_set():
            try:
                client.key_value_set(STOP_KEY, str(step + LEAD))
            except jax.errors.JaxRuntimeError as e:  # another process proposed first
                if "ALREADY_EXISTS" not in str(e):
                    raise
        if self.agreed is None:
            try:
                self.agreed = int(client.key_value_try_get(STOP_KEY))
            except jax.errors.JaxRuntimeError as e:  # nobody asked to stop
                if "NOT_FOUND" not in str(e):
                    raise
                return False
        return step >= self.agreed
