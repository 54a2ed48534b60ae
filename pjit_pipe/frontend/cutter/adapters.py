"""The two kinds of Flax model, seen the same way by the stage cutter.

A `Model` gives the cutter a pure parameter tree (nested dicts of arrays) and
a way to run the forward pass with the root module's child calls routed
through a `trace.Run`. Users keep their framework's own parameter form:

- linen: the variables dict `{'params': ...}` that `module.init` returns;
- NNX: the module's `nnx.Param` state as a pure dict
  (`nnx.to_pure_dict(nnx.state(model, nnx.Param))`), which is what
  `Pipelined.init` returns and what gradients come back as. An
  `nnx.State` is accepted as input too.

A child of an NNX root is a module attribute, or an element of a list-like
attribute (`nnx.List`, the layers of `nnx.Sequential`); its parameters are the
subtree at its path, so an NNX stage owns whole children just as a linen stage
owns whole top-level names.

An NNX module may hold random streams (`nnx.Rngs`, e.g. each
`nnx.Dropout`'s own stream). They are not trained state: every traced
microbatch first runs `nnx.reseed(model, **keys)` with that microbatch's keys
(see `rngs.py`), so microbatch i of a step draws what the unpipelined model
draws after `nnx.reseed(model, dropout=fold_in(key, i))`, whichever stage runs
which layer: reseeding walks the whole model in the same order in every stage
and restarts each stream's count. A stream held by two children (or by a child
and the root's glue) would count differently per stage, so it is refused.

The model input `x` is passed as the call's arguments (`trace.call_args`): a
dict as keyword arguments (`model(**x)`, e.g. input_ids, attention_mask,
position_ids), anything else as the one argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import flax.linen as nn
import jax
from flax import nnx

from pjit_pipe.errors import CutError
from pjit_pipe.frontend.cutter.linen_hooks import seen_through_call
from pjit_pipe.frontend.cutter.trace import Run, call_args, drive, run_module
from pjit_pipe.lowering import current_rngs

Path = tuple[Any, ...]


class Model(Protocol):
    """What the stage cutter and the pipeline need from a Flax model."""

    name: str
    children: tuple[Path, ...]  # parameter subtrees a stage owns whole

    def params(self, variables: Any) -> dict: ...
    def variables(self, params: dict) -> Any: ...
    def run(self, params: dict, x: Any, run: Run) -> Any: ...
    def init(self, rng: jax.Array, x: Any) -> Any: ...
    def apply(self, variables: Any, x: Any) -> Any: ...


class LinenModel:
    """A `flax.linen.Module`; a stage owns the parameters of the modules it calls
    (their paths, see cut.py), so `children` is empty. A root `__call__` under
    nn.jit or nn.remat is run without that decorator (`seen_through_call`)."""

    children: tuple[Path, ...] = ()

    def __init__(self, module: nn.Module):
        self.module = module
        self.name = type(module).__name__
        self._call, self.root_transform = seen_through_call(module)

    def params(self, variables: Any) -> dict:
        """The 'params' dict of a Flax variables tree; other collections are refused."""
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise CutError(
                "params: expected the Flax variables dict {'params': ...} of module.init"
            )
        extra = sorted(set(variables) - {"params"})
        if extra:
            raise CutError(
                f"params: only the 'params' collection can be pipelined, got also {extra} "
                "(mutable state such as batch statistics is not supported)"
            )
        return variables["params"]

    def variables(self, params: dict) -> Any:
        return {"params": params}

    def run(self, params: dict, x: Any, run: Run) -> Any:
        return run_module(self.module, {"params": params}, x, run, self._call)

    def init(self, rng: jax.Array, x: Any) -> Any:
        args, kwargs = call_args(x)
        return self.module.init(rng, *args, **kwargs)

    def apply(self, variables: Any, x: Any) -> Any:
        args, kwargs = call_args(x)
        return self.module.apply(variables, *args, **kwargs)


class NNXModel:
    """An `nnx.Module` instance (already initialized: NNX modules own their state)."""

    def __init__(self, module: nnx.Module):
        graphdef, params, streams, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
        if jax.tree.leaves(rest):
            kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
            raise CutError(
                f"pipeline: only nnx.Param state (and nnx.Rngs streams) can be pipelined, "
                f"{type(module).__name__} also has {kinds} (mutable state such as batch "
                "statistics is not supported)"
            )
        self.name = type(module).__name__
        self._graphdef, self._template, self._streams = graphdef, params, streams
        self._pure = nnx.to_pure_dict(params)
        self.children = tuple(path for path, _ in _children(module))
        _check_streams_unshared(module)

    def params(self, variables: Any) -> dict:
        pure = nnx.to_pure_dict(variables) if isinstance(variables, nnx.State) else variables
        if jax.tree.structure(pure) != jax.tree.structure(self._pure):
            raise CutError(
                f"params: expected the nnx.Param state of {self.name} (a pure dict or an "
                f"nnx.State), got a tree of structure {jax.tree.structure(pure)}"
            )
        return pure

    def variables(self, params: dict) -> Any:
        return params

    def sharding_names(self) -> dict[Path, tuple[Any, ...]] | None:
        """Per parameter path (the pure dict's keys), the names of its `sharding=`
        metadata (how it splits over mesh axes); None when nothing is annotated."""
        out = {}
        for path, var in nnx.to_flat_state(self._template):
            meta = var.get_metadata()
            names = next(
                (meta[k] for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k)),
                None,
            )
            if names is not None:
                out[tuple(path)] = tuple(names)
        return out or None

    def _module(self, params: dict) -> nnx.Module:
        state = jax.tree.map(lambda a: a, self._template)  # a fresh State to fill in
        nnx.replace_by_pure_dict(state, params)
        streams = jax.tree.map(lambda a: a, self._streams)  # fresh, in the current trace
        return nnx.merge(self._graphdef, state, streams)

    def run(self, params: dict, x: Any, run: Run) -> Any:
        model = self._module(params)
        keys = current_rngs() or {}
        streams = _streams(model)
        tags = {s.key.tag for s in streams} & set(keys)
        if tags:
            nnx.reseed(model, **{t: keys[t] for t in tags})
        counts = [(s, s.count.get_value()) for s in streams if s.key.tag not in tags]
        for path, child in _children(model):
            _replace(model, path, _Routed(run, "/".join(map(str, path)), child))
        args, kwargs = call_args(x)
        try:
            out = drive(run, lambda: model(*args, **kwargs))
        except (TypeError, ValueError) as e:
            if "_Routed" not in str(e):
                raise
            raise ValueError(
                f"pipeline: {self.name}.__call__ hands a child module to an NNX transform "
                "(nnx.scan, nnx.vmap, ... over a stacked layer module) instead of calling "
                "it; the stage cutter only sees calls of the root's children, so an "
                "nnx.scan stack cannot be cut: keep the layers in an nnx.List and call "
                "them in a Python loop (each may be nnx.remat'd), or write the model in "
                "linen, whose nn.scan stacks are cut between iterations"
            ) from e
        drawn = sorted({s.key.tag for s, count in counts if s.count.get_value() is not count})
        if drawn:
            raise ValueError(
                f"rngs: {self.name} draws random numbers from its nnx.Rngs streams {drawn} "
                "but the step got no keys for them; pass rngs={"
                + ", ".join(f"{t!r}: key" for t in drawn)
                + "} to the step (a single key is the 'dropout' stream), or make the "
                "model deterministic"
            )
        return out

    def init(self, rng: jax.Array, x: Any) -> Any:
        """The module's own parameters (`rng` and `x` are unused: NNX modules are
        initialized when constructed)."""
        return self._pure

    def apply(self, variables: Any, x: Any) -> Any:
        args, kwargs = call_args(x)
        return self._module(self.params(variables))(*args, **kwargs)


class _Routed:
    """Stands in for a child module: calling it is an event of the run."""

    def __init__(self, run: Run, name: str, child: Callable):
        self._run, self._name, self._child = run, name, child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run.call(self._name, self._child, args, kwargs)

    def __getattr__(self, attr: str) -> Any:
        """Another method of the child (`embed.attend(h)`) is an event too; other
        attributes (a parameter read directly) are the child's own."""
        value = getattr(self._child, attr)
        if callable(value) and not isinstance(value, nnx.Module | nnx.Variable):
            name = f"{self._name}.{attr}"
            return lambda *args, **kwargs: self._run.call(name, value, args, kwargs)
        return value


def _children(model: nnx.Module) -> list[tuple[Path, nnx.Module]]:
    """The root's direct child modules, with list-like attributes looked into."""
    out = []
    for name, value in vars(model).items():
        if name.startswith("_"):
            continue
        if isinstance(value, nnx.List | list):
            out += [((name, i), v) for i, v in enumerate(value) if isinstance(v, nnx.Module)]
        elif isinstance(value, nnx.Module):
            out.append(((name,), value))
    return out


def _streams(model: nnx.Module) -> list[nnx.RngStream]:
    return [s for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)]


def _check_streams_unshared(model: nnx.Module) -> None:
    """Refuse a random stream that two children (or a child and the root's own
    attributes) hold: its count would differ between the stages that draw from it."""
    owner: dict[int, str] = {}
    holders = [("/".join(map(str, path)), child) for path, child in _children(model)]
    holders += [
        (f"{type(model).__name__}.{name}", value)
        for name, value in vars(model).items()
        if isinstance(value, nnx.Rngs | nnx.RngStream)
    ]
    for name, node in holders:
        for stream in {id(s): s for s in _streams(node)}.values():
            first = owner.setdefault(id(stream), name)
            if first != name:
                raise ValueError(
                    f"pipeline: {first} and {name} draw from the same nnx.Rngs stream "
                    f"'{stream.key.tag}', whose count would differ between pipeline stages; "
                    "give each layer its own stream (nnx.Dropout(rate, rngs=rngs) forks "
                    "one; or pass rngs.fork())"
                )


def _replace(model: nnx.Module, path: Path, value: Any) -> None:
    if len(path) == 1:
        object.__setattr__(model, path[0], value)
    else:
        getattr(model, path[0])[path[1]] = value


def as_model(module: Any) -> Model:
    """The `Model` view of a linen or NNX module instance (a view is its own view)."""
    if isinstance(module, LinenModel | NNXModel):
        return module
    if isinstance(module, nn.Module):
        return LinenModel(module)
    if isinstance(module, nnx.Module):
        return NNXModel(module)
    raise TypeError(
        f"pipeline: expected a flax.linen.Module or flax.nnx.Module, got {type(module).__name__}"
    )
