"""Residual policies: which values of a stage's forward F stores for its backward.

F runs the stage under `jax.checkpoint(..., policy=...)` and stores the vjp
residuals the policy saves; B and W (or BW) recompute the rest from them.
Keeping more costs memory (each stored row is held from F to the backward)
and, on a GPU, the writes and reads of every stored value; keeping less costs
recomputation. Which is cheaper depends on the stage and the device, so each
virtual stage can run under its own policy, named here:

- "all": no checkpoint, every residual JAX's vjp keeps;
- "dots": `dots_saveable`, matmul outputs (the default, `DEFAULT_POLICY`);
- "dots_no_batch": `dots_with_no_batch_dims_saveable`, matmuls without batch
  dimensions (a dense layer's, not attention's score and value products);
- "names": `save_only_these_names` of the names the stage marks with
  `jax.ad_checkpoint.checkpoint_name` (offered only where it marks some);
- "nothing": `nothing_saveable`, the backward recomputes the whole forward
  from the stage input.

`remat="auto"` (frontend/planning/residual_choice.py) times each stage
under each policy and picks one per stage; `StageVjp(policies=...)` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pjit_pipe.errors import OptionError
from pjit_pipe.lowering.compute.flat_jaxpr import count_primitives

POLICIES = ("all", "dots", "dots_no_batch", "names", "nothing")
DEFAULT_POLICY = "dots"
# The checkpoint primitive's names (jax 0.10: "remat2").
REMAT_PRIMITIVES = ("checkpoint", "remat", "remat2")

_FIXED = {
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}


def check_policy(name: object) -> str:
    """`name` if it is one of `POLICIES`.

    Args:
        name: a residual policy name.

    Returns:
        The name.

    Raises:
        OptionError: `name` is not one of `POLICIES`.
    """
    if name not in POLICIES:
        raise OptionError(f"policies: expected names from {', '.join(POLICIES)}, got {name!r}")
    return str(name)


def _sub_jaxprs(value: Any) -> list[Any]:
    """The jaxprs inside one equation parameter (a jaxpr, a closed one, or a tuple of them)."""
    if isinstance(value, tuple | list):
        return [j for v in value for j in _sub_jaxprs(v)]
    if hasattr(value, "eqns"):
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        return [value.jaxpr]
    return []


def _names_in(jaxpr: Any) -> set[str]:
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            names.add(str(eqn.params["name"]))
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                names |= _names_in(sub)
    return names


def saved_names(fn: Callable, *args: Any) -> tuple[str, ...]:
    """The `checkpoint_name` names that `fn(*args)` marks, nested calls and loops included.

    Args:
        fn: a stage function.
        *args: its arguments (arrays or ShapeDtypeStructs).

    Returns:
        The names, sorted.
    """
    return tuple(sorted(_names_in(jax.make_jaxpr(fn)(*args).jaxpr)))


def default_policy(fn: Callable, *args: Any) -> str:
    """The policy of a stage given none: "all" where `fn(*args)` checkpoints parts of
    itself (`nn.remat`, `jax.checkpoint`: the model's own remat, such as the bundled
    Llama's per-layer one, then decides what its layers keep), else `DEFAULT_POLICY`.
    A stage-wide policy would override the model's: JAX applies the outer policy
    inside nested checkpoints, so "dots" would store every layer's matmul outputs.

    Args:
        fn: a stage function.
        *args: its arguments (arrays or ShapeDtypeStructs).

    Returns:
        A name from `POLICIES`.
    """
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    remats = sum(count_primitives(jaxpr, name) for name in REMAT_PRIMITIVES)
    return "all" if remats else DEFAULT_POLICY


def checkpointed(fn: Callable, policy: str, names: tuple[str, ...] = ()) -> Callable:
    """`fn` under `policy`: wrapped in `jax.checkpoint` with it, or as it is for "all".

    Args:
        fn: the forward whose vjp residuals are stored.
        policy: one of `POLICIES`.
        names: the names "names" saves (`saved_names` of the stage).

    Returns:
        The function to take the vjp of.
    """
    if policy == "all":
        return fn
    if policy == "names":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*names))
    return jax.checkpoint(fn, policy=_FIXED[check_policy(policy)])
