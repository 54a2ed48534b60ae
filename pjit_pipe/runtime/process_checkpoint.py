"""Checkpoints of a job of several processes: each process saves its own stages alone.

A checkpoint that needs every process to take part (orbax's manager: barriers
and collectives over the whole job) cannot be saved once one has died, and
its collectives, running beside a step's, can abort a survivor. Here no save
or restore needs another process. Each training process writes the
module-layout leaves (`state.params`, `state.opt_state`) of the stages its
live workers hold, unpacked from one of its own devices' rows by ops on that
device alone (no program over the mesh, so nothing waits on a peer); under
ZeRO, where a device keeps only slices of a stage's state, the slices its
own devices keep, labelled so that a restore joins them into leaves
(checkpoint_slices.py). It writes them into a
copy of its own, `step_<step>.process_<i>/`: written in a background thread
as `.step_<step>.process_<i>.partial/` and renamed into place once its files
are synced to disk. A process killed during a
save leaves a partial directory that nothing reads, so the steps saved before
stay as they were.

A step counts as saved when its complete copies together hold every leaf,
and every slice of each ZeRO part that a leaf is read from (data-parallel peers in other processes hold the same stages, so a dead
process's stages are usually in a peer's copy). Leaves are named by their
module paths and a stacked (nn.scan) leaf split over stages by its rows, so
what is saved does not depend on the cut: a restore reads the leaves its own
stages need from any complete copy, on any mesh. Each copy also holds the
step, the data position and the skipped count, as `Checkpoints` keeps them.

The files are a raw byte file and a JSON index (name, rows, dtype, shape,
offset), written with plain file I/O: orbax decides barriers, broadcasts and
which process writes from `jax.process_count()` and `jax.process_index()` at
many places, which a copy that must never wait on a peer cannot depend on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from pjit_pipe.errors import CheckpointError
from pjit_pipe.frontend import TrainState, TrainStep
from pjit_pipe.lowering import TENSOR
from pjit_pipe.runtime.checkpoint import check_directory, check_every_keep, path_name, save_due
from pjit_pipe.runtime.checkpoint_slices import ARRAYS, Sources, zero_pieces

INDEX = "index.json"  # a copy's index, beside its byte file (ARRAYS)
COPY = re.compile(r"step_(\d+)\.process_(\d+)")
# For tests: "I:S" makes process I SIGKILL itself inside its save of step S, with
# its arrays written and its index not: a real death in the middle of a save.
KILL_IN_SAVE = "PJIT_PIPE_KILL_IN_SAVE"


class _Label:
    """A module leaf's name standing in for its array in `StageCut.split`: the cut
    takes a stacked leaf's rows by slicing, which records them here."""

    def __init__(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None):
        self.name, self.shape, self.rows = name, shape, rows

    def __getitem__(self, rows: slice) -> _Label:
        return _Label(self.name, self.shape, (rows.start, rows.stop))

    def entry(self) -> dict[str, Any]:
        """The fields of this leaf's (or rows') entry in a copy's index."""
        return {"name": self.name, "rows": self.rows}


def _labelled(prefix: str, tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda p, a: _Label(f"{prefix}/{path_name(p)}", tuple(a.shape)), tree
    )


def _masked(node: Any) -> bool:
    return isinstance(node, optax.MaskedNode)


def stage_labels(view: Any) -> tuple[list[Any], list[Any], dict[str, list[int]]]:
    """(per-stage parameter trees, per-stage optax states) of `_Label`s, in the
    stages' own tree order, and {leaf name: shape} of the whole module state.
    Optax state leaves shaped like the parameters split as the parameters do;
    the others (step counts) belong to every stage (frontend/opt_state.py)."""
    params = _labelled("params", view.variables)
    template = _labelled("opt_state", view.opt_template)
    stage_params = view.cut.split(params)
    treedef = jax.tree.structure(params, _masked)
    like = lambda node: jax.tree.structure(node, _masked) == treedef  # noqa: E731
    leaves, outer = jax.tree.flatten(template, is_leaf=like)
    parts = [view.cut.split(a, _masked) if like(a) else [a] * view.cut.stages for a in leaves]
    stage_opts = [outer.unflatten([p[s] for p in parts]) for s in range(view.cut.stages)]
    shapes = {a.name: list(a.shape) for a in jax.tree.leaves((params, template))}
    return stage_params, stage_opts, shapes


def local_pieces(state: TrainState, groups: dict[str, dict]) -> Iterator[tuple[Any, np.ndarray]]:
    """(label, host array) of what the stages of this process's live workers hold:
    each module leaf, or rows of one, from one local holder's own rows, or under
    ZeRO the slices its local holders keep (checkpoint_slices.py, which adds their
    groups' descriptions to `groups`); unpacked by ops on the device that holds
    them, then copied off it; nothing from another process. A worker whose weights
    split over 'tensor' is read from its first device, each split buffer joined
    there from its T devices' parts (`_worker_rows`).

    Raises:
        CheckpointError: a worker's 'tensor' devices span processes.
    """
    state.check_alive("save")
    view, me = state.view, jax.process_index()
    layout = view.layout
    labels = stage_labels(view)[:2]
    rows = tuple(
        {k: _worker_rows(layout, b) for k, b in bufs.items()}
        for bufs in (state.device_params, state.device_opt)
    )
    T = layout.topology.tensor
    # each worker's first device (its rows, joined), and its replica
    replica = {
        d: layout.topology.workers[i // T].replica
        for i, d in enumerate(layout.devices)
        if i % T == 0
    }
    for p, held in enumerate(layout.held):
        local = [
            (d, replica[d]) for d in layout.holders(p) if d in replica and d.process_index == me
        ]
        if not local:
            continue
        if layout.zero is not None:
            yield from zero_pieces(layout, rows, labels, p, local, groups)
            continue
        first = local[0][0]
        for spec, part, names in zip(layout.specs.values(), rows, labels, strict=True):
            for c, s in enumerate(held):
                tree = spec.unpack(s, {k: row[first][c] for k, row in part.items()})
                leaves = jax.tree.leaves(tree)
                named = jax.tree.leaves(names[s])
                if len(leaves) != len(named):
                    raise CheckpointError(f"save: stage {s}'s state does not match its tree")
                yield from zip(named, (np.asarray(a) for a in leaves), strict=True)


def _worker_rows(layout: Any, buffer: jax.Array) -> dict[Any, jax.Array]:
    """{device: its (v, ...) row of `buffer`} for this process's devices. A buffer
    split over 'tensor' is joined, for each worker, on its first device from its T
    devices' parts (a worker's devices are adjacent in the layout's order); the
    others are whole on every device."""
    shards = {s.device: s.data[0] for s in buffer.addressable_shards}
    spec = tuple(buffer.sharding.spec)
    T = layout.topology.tensor
    if T == 1 or TENSOR not in spec:
        return shards
    axis = spec.index(TENSOR) - 1  # in a device's row, after its leading worker dimension
    joined = {}
    for i in range(0, len(layout.devices), T):
        group = layout.devices[i : i + T]
        mine = [d in shards for d in group]
        if not any(mine):
            continue
        if not all(mine):
            worker = layout.topology.workers[i // T]
            raise CheckpointError(
                f"save: worker ({worker.replica}, {worker.stage}) has its {T} 'tensor' devices "
                "in several processes, so no process holds its whole weights; give each "
                f"process whole workers (devices per process a multiple of {T})"
            )
        parts = np.concatenate([np.asarray(shards[d]) for d in group], axis=axis)
        joined[group[0]] = jax.device_put(parts, group[0])
    return joined


class ProcessCheckpoints:
    """Checkpoints of one process of a multi-process job (module docstring).

    The same calls as `Checkpoints`: `latest_step`, `save`, `restore`, `wait`,
    `close`. A save copies this process's leaves to the host and writes them in
    a background thread; the next save (or `wait`) waits for it first.

    Args:
        directory: Where every process's copies live (one shared folder);
            created if missing.
        every: Save when the step count is a multiple of it (and at `force`).
        keep: How many saved steps to keep (a positive integer), or None for
            all; each process deletes its own copies of older steps.

    Raises:
        CheckpointError: `every` or `keep` is not a positive integer, or
            `directory` is a file, cannot be created or is not writable.
    """

    def __init__(self, directory: str | os.PathLike, every: int = 100, keep: int | None = 3):
        check_every_keep(every, keep)
        self.directory = check_directory(directory)
        self.every, self.keep = every, keep
        self.process = jax.process_index()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None  # the background write's, raised at wait()

    def _copies(self) -> dict[int, list[dict]]:
        """Step -> the indexes of its complete copies (any process's)."""
        found: dict[int, list[dict]] = {}
        for path in self.directory.iterdir():
            match = COPY.fullmatch(path.name)
            if match is None:
                continue
            try:
                index = json.loads((path / INDEX).read_text())
            except (OSError, ValueError):
                continue  # not a complete copy
            index["path"] = path
            found.setdefault(int(match.group(1)), []).append(index)
        return found

    def saved_steps(self) -> list[int]:
        """The steps whose complete copies hold every leaf, oldest first."""
        return sorted(s for s, copies in self._copies().items() if Sources(copies).complete)

    def latest_step(self) -> int | None:
        """The newest saved step (complete copies holding every leaf), or None."""
        steps = self.saved_steps()
        return steps[-1] if steps else None

    def save(self, state: TrainState, data: Any = None, force: bool = False) -> bool:
        """Start saving this process's stages of `state` as step `state.step`, if due.

        Returns once the leaves are copied to the host; the files are written in
        the background (module docstring).

        Args:
            state: The training state.
            data: Where the data stream stands, as JSON.
            force: Save even when `state.step` is not a multiple of `every`.

        Returns:
            Whether a save was started.

        Raises:
            CheckpointError: `data` is not JSON, the state has microbatches in
                flight, or the previous save's write failed.
        """
        if not save_due(state, data, self.every, force):
            return False
        self.wait()
        final = self.directory / f"step_{state.step:08d}.process_{self.process}"
        if (final / INDEX).exists():
            return False  # already saved (e.g. the periodic save of the last step)
        groups: dict[str, dict] = {}
        pieces = list(local_pieces(state, groups))
        shapes = stage_labels(state.view)[2]
        meta = {"step": state.step, "data": data, "skipped": state.skipped, "leaves": shapes}
        meta["groups"] = groups
        self._writer = threading.Thread(target=self._write, args=(final, pieces, meta), daemon=True)
        self._writer.start()
        return True

    def _write(self, final: Path, pieces: list[tuple[Any, np.ndarray]], meta: dict) -> None:
        """Write one copy under a partial name, then rename it into place."""
        try:
            partial = final.with_name(f".{final.name}.partial")
            shutil.rmtree(partial, ignore_errors=True)  # a killed earlier try's
            partial.mkdir()
            entries, offset = [], 0
            with open(partial / ARRAYS, "wb") as f:
                for label, a in pieces:
                    f.write(a.tobytes())
                    entries.append(
                        {
                            **label.entry(),
                            "dtype": a.dtype.name,
                            "shape": list(a.shape),
                            "offset": offset,
                        }
                    )
                    offset += a.nbytes
                f.flush()
                os.fsync(f.fileno())
            if os.environ.get(KILL_IN_SAVE) == f"{self.process}:{meta['step']}":
                os.kill(os.getpid(), signal.SIGKILL)
            with open(partial / INDEX, "w") as f:
                json.dump({**meta, "pieces": entries}, f)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)  # an unfinished run's copy of this step
            partial.rename(final)
            self._prune()
        except BaseException as e:  # raised in the training thread at the next wait()
            self._error = e

    def _prune(self) -> None:
        """Delete this process's copies of steps older than the `keep` newest saved."""
        if self.keep is None:
            return
        steps = self.saved_steps()
        if len(steps) <= self.keep:
            return
        oldest = steps[-self.keep]
        for path in self.directory.iterdir():
            match = COPY.fullmatch(path.name)
            if match and int(match.group(2)) == self.process and int(match.group(1)) < oldest:
                shutil.rmtree(path, ignore_errors=True)

    def restore(
        self,
        train_step: TrainStep,
        batch: tuple[Any, Any],
        params_like: Any,
        step: int | None = None,
    ) -> tuple[TrainState, Any]:
        """Restore step `step` (None: the newest saved) into `train_step`'s layout,
        reading the leaves this process's stages need from any complete copy.

        Args:
            train_step: The step whose device layout the state is restored into.
            batch: A batch like the ones the run trains on (x, y).
            params_like: The model's parameters or their shapes.
            step: The step to restore, or None for the newest saved one.

        Returns:
            (state, data): the TrainState and the data position saved with it.

        Raises:
            CheckpointError: No step is saved, `step` is not, or the checkpoint is
                of another model or optimizer (naming the first leaf that differs).
        """
        self.wait()
        copies = self._copies()
        saved = sorted(s for s, c in copies.items() if Sources(c).complete)
        if not saved:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is not None and step not in saved:
            raise CheckpointError(
                f"step={step}: no complete checkpoint of that step in {self.directory}; "
                f"it holds steps {saved}"
            )
        step = saved[-1] if step is None else step
        sources = Sources(copies[step])
        view = train_step.view(params_like, batch)
        stage_params, stage_opts, shapes = stage_labels(view)
        meta = copies[step][0]
        for name, shape in shapes.items():
            if meta["leaves"].get(name) != shape:
                raise CheckpointError(
                    f"checkpoint {self.directory} step {step} is of another model or optimizer: "
                    f"leaf {name} is {meta['leaves'].get(name)} there and {shape} here; restore "
                    "it into the model and optimizer it was saved with"
                )
        layout, me = view.layout, jax.process_index()
        needed = {
            a.name
            for p, held in enumerate(layout.held)
            if any(d.process_index == me for d in layout.holders(p))
            for s in held
            for a in jax.tree.leaves((stage_params[s], stage_opts[s]))
        }

        def leaf(label: _Label, like: Any) -> np.ndarray:
            if label.name in needed:
                return sources.read(label.name, like.shape, like.dtype)
            return np.broadcast_to(np.zeros((), like.dtype), like.shape)  # not on this host

        params = jax.tree.map(leaf, _labelled("params", view.variables), view.variables)
        opt = jax.tree.map(leaf, _labelled("opt_state", view.opt_template), view.opt_template)
        state = train_step.init(params, batch, opt, int(meta["step"]), skipped=meta["skipped"])
        return state, meta["data"]

    def wait(self) -> None:
        """Block until the started save is on disk; raise its error if it failed.

        Raises:
            CheckpointError: the background write failed (naming why).
        """
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"save: writing this process's copy failed: {error}") from error

    def close(self) -> None:
        """Finish the pending save."""
        self.wait()
