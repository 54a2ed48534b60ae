"""Checkpoints with orbax: the module-layout state, the step and the data position.

A checkpoint stores what does not depend on the pipeline: the model's
parameters and optax state in the module's own trees (`state.params`,
`state.opt_state`), the step number, and a small JSON record of where the
data stream stands. So a run saved on one mesh, schedule or stage count
resumes on any other: restoring reads each leaf straight onto the devices of
the stage that owns it in the new pipeline (orbax reshards on read), and the
new device layout is packed there, never gathering the model on one device.

Saves are asynchronous (orbax copies the arrays off the devices, then writes
in a background thread, so training does not wait on disk) and atomic: orbax
writes into a temporary directory and renames it when complete, so a crash
mid-save leaves the previous checkpoint as the latest one.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from pjit_pipe.errors import CheckpointError
from pjit_pipe.frontend import TrainState, TrainStep

STATE, META = "state", "meta"  # the two items of a checkpoint


class _Unreadable(CheckpointError):
    """A step whose files are damaged or missing: restore() falls back past it. A
    checkpoint of another model or optimizer is not damaged, and stops it."""


def check_directory(directory: str | os.PathLike) -> Path:
    """The checkpoint directory, created if missing; raises CheckpointError when it
    is a file or cannot be written."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"--checkpoint-dir: {path} is a file, not a directory; give a directory path"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir: cannot create {path}: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"--checkpoint-dir: {path} is not writable; give a directory you can write to"
        )
    return path.resolve()


def check_every_keep(every: int, keep: int | None) -> None:
    """Raise CheckpointError unless `every` is a positive integer and `keep` one or None."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise CheckpointError(
            f"--checkpoint-every must be a positive number of steps, got {every!r}"
        )
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
        raise CheckpointError(
            f"keep: expected a positive number of checkpoints to keep, or None to keep "
            f"all, got {keep!r}"
        )


def save_due(state: TrainState, data: Any, every: int, force: bool) -> bool:
    """Whether a save of `state` is due (its step a multiple of `every`, or
    `force`), after refusing, before anything is written, what a checkpoint
    cannot hold: `data` that is not JSON, or microbatches in flight.

    Raises:
        CheckpointError: naming which, and the fix.
    """
    if not force and state.step % every:
        return False
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"save: data must be JSON (dicts, lists, strings, finite numbers, None): {e}; "
            "convert it first, e.g. arrays with .tolist()"
        ) from e
    if state.in_flight is not None:
        raise CheckpointError(
            "save: the state has microbatches in flight (a carrying async-1f1b step), "
            "which a checkpoint does not hold; save train_step.flush(state)[0] instead"
        )
    return True


class Checkpoints:
    """Orbax checkpoints of a pipelined training run in `directory`.

    What is saved does not depend on the pipeline (see the module docstring), so
    a run resumes on another mesh, schedule or stage count. `restore()` survives
    a damaged newest checkpoint (truncated or missing files, an emptied step
    directory): it warns, naming the step and why it cannot be read, moves that
    step aside to `<step>.unreadable` (so the run can save that step again) and
    restores the newest readable one.

    Args:
        directory: Where the checkpoints live; created if missing.
        every: Save when the step count is a multiple of it (and at
            `save(..., force=True)`, e.g. the end of training).
        keep: How many checkpoints to keep (a positive integer), or None for all.

    Attributes:
        directory: The resolved checkpoint directory.
        every: The save period in steps.
        manager: The orbax `CheckpointManager` that does the reads and writes.

    Raises:
        CheckpointError: `every` or `keep` is not a positive integer, or
            `directory` is a file, cannot be created or is not writable.
    """

    def __init__(self, directory: str | os.PathLike, every: int = 100, keep: int | None = 3):
        check_every_keep(every, keep)
        self.directory = check_directory(directory)
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=True
        )
        handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint.

        Returns:
            That step, or None when the directory holds no checkpoint.
        """
        return self.manager.latest_step()

    def save(self, state: TrainState, data: Any = None, force: bool = False) -> bool:
        """Start saving `state` (module layout) and `data` as step `state.step`, if due.

        Returns once the arrays are copied off the devices; the write goes on in
        the background. A step already saved (e.g. the periodic save of the last
        step) is not saved again.

        Args:
            state: The training state; saved in the module's own layout.
            data: Where the data stream stands, as JSON (dicts, lists, strings,
                finite numbers, None).
            force: Save even when `state.step` is not a multiple of `every`.

        Returns:
            Whether a save was started.

        Raises:
            CheckpointError: `data` is not JSON (raised at once, nothing is
                written), or `state` has microbatches in flight (a carrying
                async-1f1b step; save `train_step.flush(state)[0]` instead).
        """
        if not save_due(state, data, self.every, force):
            return False
        if self.manager.latest_step() == state.step:
            return False  # already saved (e.g. the periodic save of the last step)
        module = state.module_state()
        tree = {"params": module["params"], "opt_state": module["opt_state"]}
        meta = {"step": state.step, "data": data, "skipped": state.skipped}
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(tree), META: ocp.args.JsonSave(meta)}
        )
        self.manager.save(state.step, args=args, force=True)
        return True

    def restore(
        self,
        train_step: TrainStep,
        batch: tuple[Any, Any],
        params_like: Any,
        step: int | None = None,
    ) -> tuple[TrainState, Any]:
        """Restore the checkpoint of `step`, or the newest readable one, into `train_step`.

        Each leaf is read straight onto the devices of the stage that owns it in
        `train_step`'s pipeline. Waits for a save still in flight first (it is
        the latest one). Unreadable newer steps are handled as the class
        docstring says.

        Args:
            train_step: The step whose device layout the state is restored into.
            batch: A batch like the ones the run trains on (x, y); it fixes the
                layout's shapes.
            params_like: The model's parameters or their shapes
                (`jax.eval_shape` of init).
            step: The step to restore, or None for the newest readable one.

        Returns:
            (state, data): the TrainState in `train_step`'s device layout, and
            the data position that was saved with it.

        Raises:
            CheckpointError: The directory holds no checkpoint, `step` does not
                exist, a checkpoint is of another model or optimizer (naming the
                first leaf that differs), or no step can be read.
        """
        self.manager.wait_until_finished()  # a save still in flight is the latest one
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"step={step}: no checkpoint of that step in {self.directory}; it holds "
                f"steps {sorted(steps)}"
            )
        target = train_step.view(params_like, batch).module_avals()
        unreadable: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else steps:
            try:
                tree, meta = self._read(candidate, target)
            except _Unreadable as e:
                unreadable.append((candidate, str(e)))
                continue
            self._set_aside(unreadable)
            state = train_step.init(
                tree["params"],
                batch,
                tree["opt_state"],
                int(meta["step"]),
                skipped=int(meta.get("skipped", 0)),
            )
            return state, meta["data"]
        first, reason = unreadable[0]
        others = ", ".join(str(s) for s, _ in unreadable[1:])
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}: step {first}: {reason}"
            + (f" (steps {others} cannot be read either)" if others else "")
        )

    def _read(self, step: int, target: Any) -> tuple[Any, dict]:
        """The state tree and the meta record of `step`; CheckpointError saying why
        it cannot be read."""
        try:
            saved = self.manager.item_metadata(step)[STATE]
        except Exception as e:  # orbax and TensorStore raise many kinds
            raise _Unreadable(f"its metadata cannot be read ({_first_line(e)})") from e
        if saved is None:
            raise _Unreadable("it holds no saved state (an empty or partial step directory)")
        _check_same_model(saved, target, self.directory / str(step))
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}
        )
        try:
            restored = self.manager.restore(step, args=args)
            meta = restored[META]
            if not isinstance(meta, dict) or "step" not in meta:
                raise ValueError(f"its record is {meta!r}, not {{'step': ..., 'data': ...}}")
        except Exception as e:  # orbax and TensorStore raise many kinds
            raise _Unreadable(f"its data cannot be read ({_first_line(e)})") from e
        return restored[STATE], meta

    def _set_aside(self, unreadable: list[tuple[int, str]]) -> None:
        """Warn once about the unreadable newer steps and rename each to
        `<step>.unreadable`, so the resumed run can save those steps again."""
        if not unreadable:
            return
        moved = []
        for step, _ in unreadable:
            path = self.directory / str(step)
            aside = path.with_name(f"{step}.unreadable")
            if jax.process_index() == 0 and path.exists() and not aside.exists():
                path.rename(aside)
                moved.append(aside.name)
        self.manager.reload()
        reasons = "; ".join(f"step {s}: {reason}" for s, reason in unreadable)
        warnings.warn(
            f"checkpoint {reasons}; restoring the newest readable step instead"
            + (f" (moved aside to {', '.join(moved)})" if moved else ""),
            RuntimeWarning,
            stacklevel=3,
        )

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self.manager.close()


def _first_line(error: BaseException) -> str:
    """An exception as one short line (TensorStore's run to a hundred)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def path_name(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _check_same_model(saved: Any, target: Any, where: Path) -> None:
    """Raise CheckpointError at the first leaf whose path or shape differs: the
    parameters first (another model), then the optimizer state (another optimizer)."""
    saved_shapes = _shapes(saved)
    for part, other in (("params", "model"), ("opt_state", "optimizer")):
        prefix = f"{part}/"
        got = {k[len(prefix) :]: v for k, v in saved_shapes.items() if k.startswith(prefix)}
        want = _shapes(target[part])
        fix = (
            "restore it into the model it was saved from"
            if part == "params"
            else "restore it with the optimizer it was saved with"
        )
        for name, shape in want.items():
            if name not in got:
                raise CheckpointError(
                    f"checkpoint {where} is of another {other}: it has no leaf {part}/{name} (this "
                    f"{other}'s is {shape}); {fix}"
                )
            if got[name] != shape:
                raise CheckpointError(
                    f"checkpoint {where} is of another {other}: leaf {part}/{name} has shape {got[name]} "
                    f"in the checkpoint and {shape} here; {fix}"
                )
        extra = sorted(set(got) - set(want))
        if extra:
            raise CheckpointError(
                f"checkpoint {where} is of another {other}: it has leaf {part}/{extra[0]} (shape "
                f"{got[extra[0]]}), which this {other} does not; {fix}"
            )


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{leaf path: shape} of a tree of arrays or array metadata."""
    return {
        path_name(p): tuple(leaf.shape)
        for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(leaf, "shape")
    }
