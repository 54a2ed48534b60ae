"""ZeRO's slices in a process checkpoint, and reading a step back from the union of
complete copies (process_checkpoint.py).

Under ZeRO (lowering/layout/zero.py) a worker keeps of each stage's optax state
(zero=1), and of its parameters too (zero=3), only slices: each buffer of the
stage's flat layout cut into D equal slices, the worker's own and a copy of the
next replica's. A slice cuts through leaves at any offset, so no one device can
unpack a whole leaf, and a process may hold only some of a stage's slices. Each
process therefore saves, per stage and per parameter-shaped part of it (the
parameters; each parameter-shaped node of the optax state, adam's mu and nu),
the slices its own devices hold, each labelled by a *group*: the part's
description (per buffer key, the whole buffer's shape, the dimension cut and
the number of slices; per module leaf, its name, rows, key, offset, size and
shape). A group's id is a digest of its description, so the slices one group's
holders save in different processes join at a restore. The step counts beside
the slices are saved whole, as without ZeRO.

`Sources` reads a step: a leaf (or a block of a stacked leaf's rows) comes
from a whole piece or from a group whose every slice is in some complete copy:
the slices are joined into the whole buffers, and the leaf is cut out of them
with its offset, as the stage's `FlatSpec` would unpack it. The description
travels with the copy, so a restore does not rebuild the saving run's layout:
it works onto any mesh, cut or ZeRO level.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pjit_pipe.errors import CheckpointError
from pjit_pipe.lowering import DeviceLayout

ARRAYS = "arrays.bin"  # a copy's byte file: its pieces, one after another


@dataclass(frozen=True)
class SliceLabel:
    """Slice `index` of buffer `key` of a group, as a copy's index names it."""

    group: str
    key: str
    index: int

    def entry(self) -> dict[str, Any]:
        """The fields of this slice's entry in a copy's index."""
        return {"group": self.group, "key": self.key, "slice": self.index}


def zero_pieces(
    layout: DeviceLayout,
    rows: tuple[dict[str, dict[Any, jax.Array]], dict[str, dict[Any, jax.Array]]],
    labels: tuple[list[Any], list[Any]],
    position: int,
    local: list[tuple[Any, int]],
    groups: dict[str, dict],
) -> Iterator[tuple[Any, np.ndarray]]:
    """(label, host array) of the slices of one position's stages that this
    process's holders of it keep (`local`: (device, replica)), each slice once,
    unpacked by ops on the device that holds it; each group's description is
    added to `groups`. ZeRO-1 parameters are whole on every holder: their
    leaves come whole, from the first local holder.

    rows: per part (params, opt), {buffer key: {device: its (v, ...) row}};
    labels: per stage, the `_Label` trees of its parameters and optax state."""
    zero, spec = layout.zero, layout.specs["params"]
    where: dict[int, tuple[Any, int]] = {}  # slice -> (device, half): its own first
    for half in (0, 1):
        for device, replica in local:
            where.setdefault((replica + half) % zero.D, (device, half))
    like_slices = _same_tree(zero.slices)
    for c, s in enumerate(layout.held[position]):
        param_labels, opt_labels = labels[0][s], labels[1][s]

        def halves(part: int, row_spec: Any, c: int = c) -> dict[Any, Any]:
            used = {device for device, _ in where.values()}
            return {
                d: row_spec.unpack(0, {k: r[d][c] for k, r in rows[part].items()}) for d in used
            }

        if zero.level == 3:
            params = halves(0, zero.rows_spec)
            own = {j: params[d][h] for j, (d, h) in where.items()}
            yield from _group(layout, s, param_labels, own, groups)
        else:
            first = local[0][0]
            tree = spec.unpack(s, {k: r[first][c] for k, r in rows[0].items()})
            named = jax.tree.leaves(param_labels)
            yield from zip(named, (np.asarray(a) for a in jax.tree.leaves(tree)), strict=True)
        states = halves(1, zero.opt_spec)
        nodes = {
            j: jax.tree.leaves(states[d][h], is_leaf=like_slices) for j, (d, h) in where.items()
        }
        like = _same_tree(param_labels)
        named_nodes = jax.tree.leaves(opt_labels, is_leaf=like)
        any_nodes = next(iter(nodes.values()))
        if len(named_nodes) != len(any_nodes):
            raise CheckpointError(f"save: stage {s}'s optax slices do not match its tree")
        for i, named in enumerate(named_nodes):
            if like(named):
                part = {j: n[i] for j, n in nodes.items()}
                yield from _group(layout, s, named, part, groups)
            else:  # a leaf every slice's state has whole (a step count)
                yield named, np.asarray(any_nodes[i])


def _same_tree(tree: Any) -> Callable[[Any], bool]:
    """Whether a node has `tree`'s structure (a parameter-shaped node of an optax state)."""
    treedef = jax.tree.structure(tree)
    return lambda node: jax.tree.structure(node) == treedef


def _group(
    layout: DeviceLayout,
    s: int,
    labels: Any,
    slices: dict[int, dict[str, jax.Array]],
    groups: dict[str, dict],
) -> Iterator[tuple[SliceLabel, np.ndarray]]:
    """The slices (index -> {buffer key: slice}) of one parameter-shaped part of
    stage s, labelled by their group, whose description goes into `groups`."""
    zero, spec = layout.zero, layout.specs["params"]
    named = jax.tree.leaves(labels)
    if len(named) != len(spec.slots[s]):
        raise CheckpointError(f"save: stage {s}'s state does not match its tree")
    keys = {}
    for key, _, _ in spec.slots[s]:
        dim = zero.dims[key]
        shape = [int(n) for n in spec.shapes[key]]
        keys[key] = {"shape": shape, "dim": dim, "slices": 1 if dim is None else zero.D}
    leaves = [
        [a.name, a.rows, key, int(start), int(n), [int(x) for x in aval.shape]]
        for a, (key, start, n), aval in zip(named, spec.slots[s], spec.avals[s], strict=True)
    ]
    desc = {"keys": keys, "leaves": leaves}
    group = hashlib.sha1(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:20]
    groups[group] = desc
    for key, info in keys.items():
        if info["dim"] is None:  # not cut: every slice holds the whole buffer
            yield SliceLabel(group, key, 0), np.asarray(next(iter(slices.values()))[key])
            continue
        for j in sorted(slices):
            yield SliceLabel(group, key, j), np.asarray(slices[j][key])


class Sources:
    """Where each module leaf of one step is read from, over its complete copies
    (module docstring); `complete` says whether every leaf is there.

    Args:
        copies: The indexes of the step's complete copies, each with its "path".
    """

    def __init__(self, copies: list[dict]):
        self.leaves = copies[0]["leaves"]
        whole: dict[str, tuple] = {}
        blocks: dict[str, dict[int, tuple]] = {}
        self._slices: dict[str, dict[str, dict[int, tuple[Path, dict]]]] = {}
        self._groups: dict[str, dict] = {}
        self._buffers: dict[tuple[str, str], np.ndarray] = {}  # joined, for this restore

        def add(name: str, rows: list[int] | None, source: tuple) -> None:
            if rows is None:
                whole.setdefault(name, source)
            else:
                blocks.setdefault(name, {}).setdefault(rows[0], source)

        for copy in copies:
            self._groups.update(copy.get("groups", {}))
            for piece in copy["pieces"]:
                if "group" in piece:
                    held = self._slices.setdefault(piece["group"], {})
                    held.setdefault(piece["key"], {}).setdefault(
                        piece["slice"], (copy["path"], piece)
                    )
                else:
                    add(piece["name"], piece["rows"], ("file", piece["rows"], copy["path"], piece))
        for group, desc in self._groups.items():
            held = self._slices.get(group, {})
            if all(
                set(range(info["slices"])) <= set(held.get(key, {}))
                for key, info in desc["keys"].items()
            ):
                for name, rows, *place in desc["leaves"]:
                    add(name, rows, ("group", rows, group, *place))
        self.chains: dict[str, list[tuple]] = {}
        self.complete = True
        for name, shape in self.leaves.items():
            if name in whole:
                self.chains[name] = [whole[name]]
                continue
            chain, row = [], 0
            while row < shape[0] and row in blocks.get(name, {}):
                chain.append(blocks[name][row])
                row = chain[-1][1][1]
            if not chain or row != shape[0]:
                self.complete = False
                return
            self.chains[name] = chain

    def read(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """Leaf `name` (its row blocks concatenated in order), as `dtype`.

        Raises:
            CheckpointError: what the copies give is not of `shape`.
        """
        parts = [self._part(source) for source in self.chains[name]]
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if whole.shape != tuple(shape):
            raise CheckpointError(
                f"checkpoint: leaf {name} is of shape {whole.shape} in the copies, not {shape}"
            )
        return whole.astype(dtype)

    def _part(self, source: tuple) -> np.ndarray:
        if source[0] == "file":
            return _read_piece(source[2], source[3])
        _, _, group, key, start, n, shape = source
        return self._buffer(group, key).reshape(-1)[start : start + n].reshape(shape)

    def _buffer(self, group: str, key: str) -> np.ndarray:
        """Buffer `key` of a group, its slices joined along the dimension cut."""
        if (group, key) not in self._buffers:
            info = self._groups[group]["keys"][key]
            held = self._slices[group][key]
            parts = [_read_piece(*held[j]) for j in range(info["slices"])]
            joined = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=info["dim"])
            self._buffers[group, key] = joined.reshape(info["shape"])
        return self._buffers[group, key]


def _read_piece(path: Path, piece: dict) -> np.ndarray:
    """One piece's array from its copy's byte file."""
    count = int(np.prod(piece["shape"]))
    kind = jnp.dtype(piece["dtype"])  # bfloat16 too
    with open(path / ARRAYS, "rb") as f:
        f.seek(piece["offset"])
        raw = f.read(count * kind.itemsize)
    return np.frombuffer(raw, dtype=kind).reshape(piece["shape"])
