"""`SkipLog`: the count of skipped non-finite steps, each step's flag read lazily.

A train step decides on the device whether its update is skipped
(PipelineOptions.skip_nonfinite) and returns that flag next to its loss.
Reading the flag on the host at once would wait for the step to finish, so the
next step could not be dispatched while this one runs. The log keeps each
step's flag as a device scalar instead and reads it later: when the count is
asked for (`TrainState.skipped`, which waits for the step), or once the next
step has been dispatched, when the device already has that step to run. The
RuntimeWarning that names a skipped step is given when its flag is read, once.
"""

from __future__ import annotations

import warnings

import jax

# The caller's frame as the warning's stacklevel: _Verdict.read, SkipLog._read, then
# SkipLog.count or SkipLog.settled, then TrainState.skipped or TrainStep.__call__.
_CALLER_LEVEL = 5


class _Verdict:
    """One step's skip flag, read on the host at most once."""

    def __init__(self, step: int, flag: jax.Array, loss: jax.Array):
        self.step = step  # the step's number (TrainState.step before it)
        self.flag = flag  # () bool device scalar: the update was skipped
        self.loss = loss  # the step's loss, for the warning
        self._skipped: bool | None = None

    def read(self) -> bool:
        """Whether the step was skipped; the first read waits for the step and warns."""
        if self._skipped is None:
            self._skipped = bool(self.flag)
            if self._skipped:
                warnings.warn(
                    f"step {self.step}: the loss ({float(self.loss)}) or the global gradient "
                    "norm is not finite; the update was skipped (parameters and optimizer "
                    "state unchanged)",
                    RuntimeWarning,
                    stacklevel=_CALLER_LEVEL,
                )
            self.flag = self.loss = None  # read: the device scalars are no longer needed
        return self._skipped


class SkipLog:
    """The skipped steps so far: a count already read plus steps not read yet.

    Immutable to its users: each step makes a new log, and a verdict shared by
    an older state's log and a newer one is read (and warned about) once.
    """

    def __init__(self, counted: int = 0, pending: tuple[_Verdict, ...] = ()):
        """A log of `counted` skipped steps and the verdicts in `pending`, unread.

        Args:
            counted: skipped steps already known (e.g. from a checkpoint).
            pending: verdicts of later steps, oldest first.
        """
        self._counted = counted
        self._pending = pending

    def count(self) -> int:
        """The skipped steps: reads every pending flag (waits for those steps).

        Returns:
            The number of skipped steps in this log.
        """
        return self._read()

    def _read(self) -> int:
        """The count, each pending flag read (a loop, not a generator: the warning's
        stacklevel counts the frames up to the caller)."""
        count = self._counted
        for verdict in self._pending:
            count += verdict.read()
        return count

    def settled(self) -> SkipLog:
        """This log with every pending flag read: call once a later step is dispatched.

        Returns:
            A log with the same count and nothing pending.
        """
        if not self._pending:
            return self
        return SkipLog(self._read())

    def then(self, step: int, flag: jax.Array, loss: jax.Array) -> SkipLog:
        """This log and one more step's verdict, not read yet.

        Args:
            step: the step's number.
            flag: its () bool device scalar, True where its update was skipped.
            loss: its loss (named in the warning).

        Returns:
            A log that reads `flag` when asked for its count or settled.
        """
        return SkipLog(self._counted, (*self._pending, _Verdict(step, flag, loss)))
