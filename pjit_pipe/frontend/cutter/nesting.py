"""Where a linen model's repeated blocks sit: the containers the stage cutter looks into.

Real models keep their blocks one or two levels below the root: Hugging
Face's Llama at `model.layers.N`, its GPT-2 at `transformer.h.N`, BERT at
`bert.encoder.layer.N`. The cutter's events are the calls of modules one
level below a *container* (`trace.py`); the root is always one. A recording
run notes every module call as a tree (`CallTree`), and `choose_levels`
makes a module a container when it holds a *stack* somewhere below it and its
own level has none: a stack is two or more consecutive calls, at one level,
of different modules of one class that call modules themselves (blocks, not
two `Dense` or `Embed` layers side by side). So a root that already calls its
blocks is cut as before, and a wrapped model is cut between the blocks of its
stack, with the modules beside the stack (embeddings, final norm) as events
of their own.

A module under a linen transform (nn.remat, nn.jit, nn.scan of a child) is
never a container: the transform traces it apart, where a stage could not
end. A split point named by the user (`pipeline(..., split_points=[...])`)
makes the modules above it containers (`containers_above`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Path = tuple[str, ...]


def module_name(path: Path) -> str:
    """A module's path as people write it: "transformer.h.0"."""
    return ".".join(path)


def _is_lifted(module: Any) -> bool:
    """A class that a linen transform made (nn.remat(Block) is "CheckpointBlock",
    a subclass of Block): its calls are traced inside the transform."""
    cls = type(module)
    base = cls.__mro__[1].__name__
    return base != "Module" and cls.__name__ != base and cls.__name__.endswith(base)


def _class_name(module: Any) -> str:
    """The class a block is made of, under a transform's lifted class."""
    cls = type(module)
    return cls.__mro__[1].__name__ if _is_lifted(module) else cls.__name__


class CallTree:
    """The module calls of one forward pass, as a tree of module paths.

    children[p]: the paths of the modules called from the call of p (p=() is the
    root), each once, in the order first called; kind[p]: its class name;
    lifted: the paths whose module is under a linen transform.
    """

    def __init__(self) -> None:
        self.children: dict[Path, list[Path]] = {}
        self.kind: dict[Path, str] = {}
        self.lifted: set[Path] = set()

    def note(self, parent: Path, path: Path, module: Any) -> None:
        """The module at `path` was called from the call of `parent`."""
        siblings = self.children.setdefault(parent, [])
        if path in self.kind:  # called before (a scan body traced twice, a reused module)
            return
        siblings.append(path)
        self.kind[path] = _class_name(module)
        if _is_lifted(module):
            self.lifted.add(path)

    def paths(self) -> dict[str, Path]:
        """Every called module, by its dotted name."""
        return {module_name(p): p for p in self.kind}

    def _composite(self, path: Path) -> bool:
        return bool(self.children.get(path))

    def has_stack(self, path: Path) -> bool:
        """Whether the call of `path` calls a stack: two or more consecutive modules of
        one class that call modules themselves."""
        run, last = 0, None
        for child in self.children.get(path, ()):
            kind = self.kind[child] if self._composite(child) else None
            run = run + 1 if kind is not None and kind == last else 1
            last = kind
            if kind is not None and run >= 2:
                return True
        return False

    def holds_stack(self, path: Path) -> bool:
        """Whether a stack is called somewhere below `path` (through calls that can
        be containers)."""
        if path in self.lifted:
            return False
        return self.has_stack(path) or any(self.holds_stack(c) for c in self.children.get(path, ()))


def choose_levels(tree: CallTree) -> frozenset[Path]:
    """The containers: the root, and every module on the way down to a stack when
    the level above has none (see the module doc)."""
    levels: set[Path] = {()}

    def expand(path: Path) -> None:
        if tree.has_stack(path):
            return  # its children, the stack among them, are the events
        for child in tree.children.get(path, ()):
            if tree.holds_stack(child):
                levels.add(child)
                expand(child)

    expand(())
    return frozenset(levels)


def containers_above(tree: CallTree, names: Iterable[str]) -> frozenset[Path]:
    """The modules above each named split point that is a called module, so that the
    point is an event; names that are not called modules, or that sit under a
    transform, add nothing (the cut refuses them by name)."""
    paths = tree.paths()
    levels: set[Path] = set()
    for name in names:
        path = paths.get(name)
        if path is None:
            continue
        above = [path[:k] for k in range(1, len(path))]
        if any(p in tree.lifted for p in above):
            continue
        levels.update(above)
    return frozenset(levels)
