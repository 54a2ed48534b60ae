"""One virtual stage as the lowering sees it: a forward whose vjp residuals can be stored.

The last stage folds the loss in, so its output is the microbatch loss; the
first stage reads the raw microbatch and takes no input gradient. F keeps the
vjp residuals that B and W need (matmul outputs; see SAVE_DOTS); residuals that are the stage's own parameter
arrays are not stored but re-read from the parameter buffer (parameters do not
change within an iteration), so weights are never copied per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.lowering.packing import Buffers, FlatSpec

# Residuals kept from F: matmul outputs (and the stage input); B and W recompute
# only the cheap elementwise ops from them, which is what XLA's fusion does in an
# unpipelined step anyway, at a fraction of the memory traffic of every residual.
SAVE_DOTS = jax.checkpoint_policies.dots_saveable


class StageVjp:
    """Forward/backward of every virtual stage, with residual packing.

    After `__init__` (an abstract pass over the stage chain), `act_avals[s]` is
    the input of stage s, `res[s]` the layout of its stored residuals, and
    `res_spec` the flat residual buffers shared by all stages.
    """

    def __init__(
        self,
        stage_fns: Sequence[Callable],
        loss_fn: Callable,
        stage_params: Sequence[Any],
        x_mb: Any,
        y_mb: Any,
    ):
        self.fns = list(stage_fns)
        self.loss_fn = loss_fn
        self.S = len(self.fns)
        self.param_avals = [jax.eval_shape(lambda p: p, p) for p in stage_params]
        self.act_avals: list[Any] = [x_mb]
        for s in range(self.S - 1):
            self.act_avals.append(
                jax.eval_shape(self.fns[s], self.param_avals[s], self.act_avals[s])
            )
        self.res_treedef: list[Any] = []
        self.res_where: list[list[tuple[str, int]]] = []
        stored = []
        for s in range(self.S):
            box: dict[str, Any] = {}

            def probe(p, a, y, s=s, box=box):
                out, pull, where, leaves = self._vjp_parts(s, p, a, y)
                box["where"], box["treedef"] = where, jax.tree.structure(pull)
                return out, leaves

            loss, leaves = jax.eval_shape(probe, self.param_avals[s], self.act_avals[s], y_mb)
            if s == self.S - 1 and (loss.ndim != 1 or loss.dtype != jnp.float32):
                raise ValueError(
                    f"loss_fn must return a float32 vector (see loss.LossLayout), got {loss}"
                )
            self.res_where.append(box["where"])
            self.res_treedef.append(box["treedef"])
            stored.append(leaves)
        self.loss_aval = loss
        self.res_spec = FlatSpec(stored)

    def forward(self, s: int, p: Any, a: Any, y: Any) -> Any:
        out = self.fns[s](p, a)
        return self.loss_fn(out, y) if s == self.S - 1 else out

    def _vjp_parts(self, s: int, p: Any, a: Any, y: Any):
        """(output, pullback, residual origin list, stored residual leaves)."""
        fwd = jax.checkpoint(lambda p, a: self.forward(s, p, a, y), policy=SAVE_DOTS)
        if s == 0:
            out, pull = jax.vjp(lambda p: fwd(p, a), p)
        else:
            out, pull = jax.vjp(fwd, p, a)
        leaves = jax.tree.leaves(pull)
        param_leaves = jax.tree.leaves(p)
        where, stored, seen = [], [], {}
        for leaf in leaves:
            k = next((i for i, q in enumerate(param_leaves) if leaf is q), None)
            if k is not None:
                where.append(("param", k))
            else:
                if id(leaf) not in seen:
                    seen[id(leaf)] = len(stored)
                    stored.append(leaf)
                where.append(("stored", seen[id(leaf)]))
        return out, pull, where, stored

    def forward_with_residuals(self, s: int, p: Any, a: Any, y: Any) -> tuple[Any, Buffers]:
        """F: the stage output and its packed non-parameter residuals."""
        out, _, where, stored = self._vjp_parts(s, p, a, y)
        if where != self.res_where[s]:
            raise RuntimeError(f"stage {s}: vjp residual structure changed between traces")
        return out, self.res_spec.pack(s, stored)

    def pullback(self, s: int, p: Any, res: Buffers) -> Callable:
        """The stage's vjp function rebuilt from stored residuals and current parameters."""
        stored = jax.tree.leaves(self.res_spec.unpack(s, res))
        param_leaves = jax.tree.leaves(p)
        leaves = [param_leaves[i] if src == "param" else stored[i] for src, i in self.res_where[s]]
        return jax.tree.unflatten(self.res_treedef[s], leaves)

    def recompute_pullback(self, s: int, p: Any, a: Any, y: Any) -> Callable:
        """The stage's vjp function by re-running its forward (remat)."""
        return self._vjp_parts(s, p, a, y)[1]
