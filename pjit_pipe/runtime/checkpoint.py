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

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from pjit_pipe.errors import CheckpointError
from pjit_pipe.frontend.state import TrainState
from pjit_pipe.frontend.train_step import TrainStep

STATE, META = "state", "meta"  # the two items of a checkpoint


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


class Checkpoints:
    """Orbax checkpoints of a pipelined training run in `directory`.

    every: save when the step count is a multiple of it (and at `save(...,
    force=True)`, e.g. the end of training); keep: how many to keep.
    """

    def __init__(self, directory: str | os.PathLike, every: int = 100, keep: int = 3):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise CheckpointError(
                f"--checkpoint-every must be a positive number of steps, got {every!r}"
            )
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
        """The step of the newest complete checkpoint, or None."""
        return self.manager.latest_step()

    def save(self, state: TrainState, data: Any = None, force: bool = False) -> bool:
        """Start saving `state` (module layout) and `data` (JSON: where the data
        stream stands) as step `state.step`, if due; returns whether it saves.
        Returns once the arrays are copied off the devices; the write goes on in
        the background."""
        if not force and state.step % self.every:
            return False
        if state.in_flight is not None:
            raise CheckpointError(
                "save: the state has microbatches in flight (a carrying async-1f1b step), "
                "which a checkpoint does not hold; save train_step.flush(state)[0] instead"
            )
        if self.manager.latest_step() == state.step:
            return False  # already saved (e.g. the periodic save of the last step)
        module = state.module_state()
        tree = {"params": module["params"], "opt_state": module["opt_state"]}
        args = ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(tree),
                META: ocp.args.JsonSave({"step": state.step, "data": data}),
            }
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
        """(TrainState in `train_step`'s device layout, saved data position) from the
        checkpoint of `step` (default the latest). `params_like`: the model's
        parameters or their shapes (jax.eval_shape of init). Raises CheckpointError
        naming the first leaf whose shape differs when the checkpoint is of another
        model."""
        self.manager.wait_until_finished()  # a save still in flight is the latest one
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        view = train_step.view(params_like, batch)
        target = view.module_avals()
        saved = self.manager.item_metadata(step)[STATE]
        _check_same_model(saved, target, self.directory / str(step))
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(target), META: ocp.args.JsonRestore()}
        )
        restored = self.manager.restore(step, args=args)
        tree, meta = restored[STATE], restored[META]
        state = train_step.init(tree["params"], batch, tree["opt_state"], int(meta["step"]))
        return state, meta["data"]

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self.manager.close()


def _path_name(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _check_same_model(saved: Any, target: Any, where: Path) -> None:
    """Raise CheckpointError at the first leaf whose path or shape differs."""
    got = dict(
        (_path_name(p), tuple(leaf.shape))
        for p, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]
        if hasattr(leaf, "shape")
    )
    for p, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = _path_name(p)
        want = tuple(np.shape(leaf))
        if name not in got:
            raise CheckpointError(
                f"checkpoint {where} is of another model: it has no leaf {name} "
                f"(this model's is {want})"
            )
        if got[name] != want:
            raise CheckpointError(
                f"checkpoint {where} is of another model: leaf {name} has shape "
                f"{got[name]} in the checkpoint and {want} in this model"
            )
    extra = sorted(
        set(got) - {_path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(target)[0]}
    )
    if extra:
        raise CheckpointError(
            f"checkpoint {where} is of another model: it has leaf {extra[0]} "
            f"(shape {got[extra[0]]}), which this model does not"
        )
