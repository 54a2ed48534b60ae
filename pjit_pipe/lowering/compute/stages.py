"""One virtual stage as the lowering sees it: a forward whose vjp residuals can be stored.

The last stage folds the loss in, so its output is the microbatch loss; the
first stage reads the raw microbatch and takes no input gradient. F keeps the
vjp residuals that B and W need, those its residual policy saves (matmul outputs
by default; residual_policy.py, one policy per stage); residuals that are the
stage's own parameter arrays are not stored but re-read from the parameter
buffer (parameters do not change within an iteration), so weights are never
copied per microbatch.

Stages listed in `split` (those the schedule runs as separate B and W, except
the first, whose B is empty) use the split backward of `split_backward.py`.
Stored values live in two pools with their own slots, so each is freed by
the last op that reads it:

- the B-pool row (split stages only): the vjp residuals w.r.t. (input, site
  perturbations), written by F and read by B (or BW), which frees it;
- the W-pool row: a split stage's data operands W reads (written by F) and
  site cotangents (written by B); any other stage's vjp residuals. The
  stage's last backward op (W or BW) frees it.

A stage that is not split (a fused BW, or the first stage, whose W does the
whole backward) thus uses one pool, the one freed last, whatever the pool
its neighbours use: one SPMD program sizes each pool by its busiest device.

A pool row keeps as many leaves in size classes (flat_buffers.py: a buffer
per leaf size, the leaf whole at offset 0) as cost no bytes over one flat row
per dtype (`FlatSpec.compact_classes`); the rest sit in the flat row. XLA
makes a kernel of each write and read of a stored leaf, and in a flat row
each leaf of each stage sits at its own offset: every one a kernel of its
own. In a class, the same-sized leaves of different stages are written and
read by one kernel, compiled once: on the tiny GPT (2x4, zb-h1) the step's
kernels go from 279 to 254, at the same speed (docs/performance.md).

With weights split over 'tensor' (`tensor_split`), both pools' rows are
replicated over it (flat_buffers.py): they hold split values (a column-parallel
matmul's output, its cotangent) next to replicated ones, and a row XLA shards
like its split values is sliced with collective-permutes inside a stage's
branch (docs/tensor_parallel.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pjit_pipe.errors import LossFnError, OptionError
from pjit_pipe.ir.memory import StoredBytes
from pjit_pipe.lowering.compute.compute_dtype import compute_dtypes
from pjit_pipe.lowering.compute.remat_regions import region_residual_bytes
from pjit_pipe.lowering.compute.replay import TracedOnce
from pjit_pipe.lowering.compute.residual_policy import (
    check_policy,
    checkpointed,
    default_policy,
    saved_names,
)
from pjit_pipe.lowering.compute.stage_backward import SplitBackward
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec

# A pool row's size classes hold no more bytes than its flat row (module
# docstring): they buy compile time, which is not worth memory in every stored row.
MAX_POOL_CLASS_OVERHEAD = 1.0


class Residuals(NamedTuple):
    """One microbatch's stored rows (or a store of them, with a leading slot axis)."""

    b: Buffers  # B-pool: a split stage's vjp residuals, F -> B
    w: Buffers  # W-pool: a split stage's W operands (F) and cotangents (B), any other
    #             stage's vjp residuals; freed by the stage's W or BW


class StageVjp:
    """Forward/backward of every virtual stage, with residual packing.

    After `__init__` (an abstract pass over the stage chain), `act_avals[s]` is
    the input of stage s, and `b_spec` / `w_spec` the B-pool / W-pool rows
    (module docstring) shared by all stages (a stage's tree number s in each).
    `policies[s]`: the residual policy stage s's F stores under
    (residual_policy.POLICIES); None: each stage's `default_policy`, "all" where
    the model checkpoints its own layers (nn.remat), else DEFAULT_POLICY. That
    default, matmul outputs (and the stage input), leaves B and W only the cheap
    elementwise ops to recompute, which is what XLA's fusion does in an
    unpipelined step anyway, at a fraction of the memory traffic of every
    residual. `tensor_split`: some weight is split over
    the mesh's 'tensor' axis, so the pools' rows are pinned replicated over it
    (module docstring).
    """

    def __init__(
        self,
        stage_fns: Sequence[Callable],
        loss_fn: Callable,
        stage_params: Sequence[Any],
        x_mb: Any,
        y_mb: Any,
        split: Collection[int] = (),
        policies: Sequence[str] | None = None,
        tensor_split: bool = False,
    ):
        self.fns = list(stage_fns)
        self.tensor_split = tensor_split
        # (computation, stage) -> its jaxpr, traced once for every program (replay.py)
        self._replayed: dict[tuple[str, int], TracedOnce] = {}
        self.loss_fn = loss_fn
        self.S = len(self.fns)
        self.param_avals = [jax.eval_shape(lambda p: p, p) for p in stage_params]
        # Per stage, per parameter leaf, the dtype the stage computes it in (None: its
        # own): every method takes the master leaves and computes on them cast to it.
        self.compute_dtypes: list[list[Any]] = []
        given = [check_policy(p) for p in policies or ()]
        if policies and len(given) != self.S:
            raise OptionError(
                f"policies: give one residual policy per virtual stage ({self.S}), got {policies!r}"
            )
        self.split = frozenset(s for s in split if 0 < s < self.S)
        self.act_avals: list[Any] = [x_mb]  # stage s's input
        self.saved_names: dict[int, Any] = {}  # a "names" stage's: the names it marks
        self.splitters: dict[int, SplitBackward] = {}
        # Per stage, where each leaf of its pullback comes from (a parameter, or a
        # stored residual) and the pullback's tree: recorded by its first F trace.
        self.res_where: dict[int, list[tuple[str, int]]] = {}
        self.res_treedef: dict[int, Any] = {}
        stored, kept = [], []
        for s in range(self.S):
            self.compute_dtypes.append(
                compute_dtypes(self.fns[s], self.param_avals[s], self.act_avals[s])
            )
            if not policies:
                given.append(default_policy(self.fns[s], self.param_avals[s], self.act_avals[s]))
            self.policies = tuple(given)
            p, a, y = self.compute_avals(s), self.act_avals[s], y_mb if s == self.S - 1 else None
            if self.policies[s] == "names":
                self.saved_names[s] = saved_names(self.fns[s], p, a)
            if s in self.split:
                fn = lambda p, a, y, s=s: self.forward(s, p, a, y)  # noqa: E731
                self.splitters[s] = SplitBackward(fn, p, a, y)
            # F's first trace, which the programs' F ops replay (replay.py); its
            # output is the next stage's input.
            out, leaves = jax.eval_shape(self._replay("F", s, self._forward_stored), p, a, y)
            out = out[0] if s in self.split else out
            if s < self.S - 1:
                self.act_avals.append(out)
            elif out.ndim != 1 or out.dtype != jnp.float32:
                raise LossFnError(
                    f"loss_fn must return a float32 vector (see loss.LossLayout), got {out}"
                )
            # A split stage also keeps W's data operands and the site cotangents B writes.
            sb = self.splitters.get(s)
            stored.append(leaves if sb else [])
            kept.append([sb.stored, sb.perturbations] if sb else leaves)
        self.loss_aval = out
        self.b_spec = FlatSpec.compact_classes(
            stored, MAX_POOL_CLASS_OVERHEAD, replicated=tensor_split
        )
        self.w_spec = FlatSpec.compact_classes(
            kept, MAX_POOL_CLASS_OVERHEAD, replicated=tensor_split
        )

    def cast(self, s: int, p: Any) -> Any:
        """Stage s's parameters as it computes on them: each leaf the model casts to a
        narrower float in its one use, cast already (compute_dtype.py), so its
        gradient comes back in that dtype with the same values."""
        leaves, treedef = jax.tree.flatten(p)
        cast = [
            leaf if d is None else leaf.astype(d)
            for leaf, d in zip(leaves, self.compute_dtypes[s], strict=True)
        ]
        return jax.tree.unflatten(treedef, cast)

    def compute_avals(self, s: int) -> Any:
        """Stage s's parameter avals in the dtypes it computes them in (`cast`)."""
        return jax.eval_shape(functools.partial(self.cast, s), self.param_avals[s])

    def zero_residuals(self, *lead: int) -> Residuals:
        """Empty B-pool and W-pool stores with leading dimensions `lead`."""
        return Residuals(self.b_spec.zeros(*lead), self.w_spec.zeros(*lead))

    def forward(self, s: int, p: Any, a: Any, y: Any) -> Any:
        out = self.fns[s](p, a)
        return self.loss_fn(out, y) if s == self.S - 1 else out

    def remat_forward(self, s: int, p: Any, a: Any, y: Any) -> Any:
        """F under remat: the stage output (the loss vector on the last stage) and
        nothing stored; `recompute_backward` runs the forward again."""
        return self._replay("remat F", s, self.forward)(self.cast(s, p), a, y)

    def _vjp_parts(self, s: int, p: Any, a: Any, y: Any):
        """(output, pullback, residual origin list, stored residual leaves); a split
        stage's pullback is w.r.t. (input, perturbations) and its output is
        (stage output, W's data operands)."""
        if s in self.split:
            sb = self.splitters[s]
            y = y if s == self.S - 1 else None
            fwd = self._checkpointed(s, lambda p, a, eps: sb.forward(p, a, y, eps))
            out, pull, operands = jax.vjp(
                lambda a, eps: fwd(p, a, eps), a, sb.zero_perturbations(), has_aux=True
            )
            out = (out, operands)
        else:
            out, pull = self._plain_vjp(s, p, a, y)
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

    def _replay(self, name: str, s: int, compute: Callable) -> TracedOnce:
        """`compute(s, ...)` traced once for every program (replay.py); traced anew each
        time where the stage's weights split over 'tensor'."""
        key = (name, s)
        if key not in self._replayed:
            fn = functools.partial(compute, s)
            self._replayed.setdefault(key, TracedOnce(fn, enabled=not self.tensor_split))
        return self._replayed[key]

    def _forward_stored(self, s: int, p: Any, a: Any, y: Any) -> tuple[Any, list[Any]]:
        """F's compute: (output, the vjp residual leaves it stores)."""
        out, pull, where, stored = self._vjp_parts(s, p, a, y)
        if self.res_where.setdefault(s, where) != where:
            raise RuntimeError(f"stage {s}: vjp residual structure changed between traces")
        self.res_treedef.setdefault(s, jax.tree.structure(pull))
        return out, stored

    def _checkpointed(self, s: int, fn: Callable) -> Callable:
        """`fn`, stage s's forward, under the stage's residual policy."""
        return checkpointed(fn, self.policies[s], self.saved_names.get(s, ()))

    def _plain_vjp(self, s: int, p: Any, a: Any, y: Any):
        fwd = self._checkpointed(s, lambda p, a: self.forward(s, p, a, y))
        if s == 0:
            out, pull = jax.vjp(lambda p: fwd(p, a), p)
        else:
            out, pull = jax.vjp(fwd, p, a)
        return out, pull

    def forward_into(
        self, s: int, p: Any, a: Any, y: Any, store: Residuals, b_slot: Any, w_slot: Any
    ) -> tuple[Any, Residuals]:
        """F: the stage output, and `store` with what F keeps written in place, leaf
        by leaf: a split stage's vjp residuals into B-pool row `b_slot` and W's data
        operands into the head of W-pool row `w_slot` (B writes the cotangents
        after them); any other stage's vjp residuals into W-pool row `w_slot`."""
        out, stored = self._replay("F", s, self._forward_stored)(self.cast(s, p), a, y)
        if s not in self.split:
            return out, store._replace(w=self.w_spec.write(s, store.w, w_slot, stored))
        (out, operands) = out
        return out, Residuals(
            self.b_spec.write(s, store.b, b_slot, stored),
            self.w_spec.write(s, store.w, w_slot, jax.tree.leaves(operands)),
        )

    def stored_rows(self, s: int, p: Any, a: Any, y: Any) -> tuple[Any, Residuals]:
        """F alone, outside a tick program: the stage output and one microbatch's
        B-pool and W-pool rows (zeros where F writes nothing), as B and W read them."""
        out, store = self.forward_into(s, p, a, y, self.zero_residuals(1), 0, 0)
        return out, jax.tree.map(lambda b: b[0], store)

    def pullback(self, s: int, p: Any, res: Residuals) -> Callable:
        """The stage's vjp function rebuilt from its stored residuals and current
        parameters (a split stage's: w.r.t. its input and site perturbations)."""
        spec, row = (self.b_spec, res.b) if s in self.split else (self.w_spec, res.w)
        stored = jax.tree.leaves(spec.unpack(s, row))
        param_leaves = jax.tree.leaves(self.cast(s, p))
        leaves = [param_leaves[i] if src == "param" else stored[i] for src, i in self.res_where[s]]
        return jax.tree.unflatten(self.res_treedef[s], leaves)

    def value_and_grad(self, s: int, p: Any, a: Any, y: Any, seed: Any) -> tuple[Any, Any, Any]:
        """The loss stage's F and backward as one program: (loss vector, parameter
        gradient, input gradient or None on stage 0) for the loss vector's
        cotangent `seed`. Nothing is stored: with forward and backward in one
        computation XLA keeps or recomputes intermediates as it likes, as in a
        plain `jax.value_and_grad` (no checkpoint policy, no packed rows)."""
        return self._replay("FUSED", s, self._value_and_grad)(self.cast(s, p), a, y, seed)

    def _value_and_grad(self, s: int, p: Any, a: Any, y: Any, seed: Any) -> tuple[Any, Any, Any]:
        if s == 0:  # the raw batch may be integers: no input gradient
            out, pull = jax.vjp(lambda p: self.forward(s, p, a, y), p)
            return out, pull(seed)[0], None
        out, pull = jax.vjp(lambda p, a: self.forward(s, p, a, y), p, a)
        dparams, dinput = pull(seed)
        return out, dparams, dinput

    def backward(self, s: int, p: Any, res: Residuals, g: Any) -> Any:
        """The stage's vjp of the output cotangent `g` from its stored residuals:
        (parameter gradient, input gradient), or (parameter gradient,) on stage 0; a
        split stage's is w.r.t. (input, site perturbations): (input gradient, site
        cotangents)."""
        return self._replay("pull", s, self._pull)(self.cast(s, p), res, g)

    def _pull(self, s: int, p: Any, res: Residuals, g: Any) -> Any:
        return self.pullback(s, p, res)(g)

    def recompute_backward(self, s: int, p: Any, a: Any, y: Any, g: Any) -> Any:
        """`backward` by re-running the stage's forward (remat) instead of reading
        stored residuals."""
        return self._replay("remat BW", s, self._recompute_backward)(self.cast(s, p), a, y, g)

    def _recompute_backward(self, s: int, p: Any, a: Any, y: Any, g: Any) -> Any:
        return self._vjp_parts(s, p, a, y)[1](g)

    # ---- the split backward (stages in `split`) ----

    def input_grad(
        self, s: int, p: Any, res: Residuals, g: Any, w_store: Buffers, slot: Any
    ) -> tuple[Any, Buffers]:
        """B: (input gradient, `w_store` with the site cotangents written into W-pool
        row `slot` after W's data operands, leaf by leaf in place)."""
        dinput, cots = self.backward(s, p, res, g)
        first = len(self.splitters[s].stored)  # the row's leaves before the cotangents
        return dinput, self.w_spec.write(s, w_store, slot, jax.tree.leaves(cots), first)

    def weight_grad(self, s: int, p: Any, res: Residuals) -> Any:
        """W: the parameter gradient from the W-pool row's data operands and cotangents."""
        return self._replay("W", s, self._weight_grad)(self.cast(s, p), res)

    def _weight_grad(self, s: int, p: Any, res: Residuals) -> Any:
        operands, cots = self.w_spec.unpack(s, res.w)
        return self.splitters[s].weight_grads(p, operands, cots)

    def fused_grad(self, s: int, p: Any, res: Residuals, g: Any) -> tuple[Any, Any]:
        """BW of a split stage: B then W without storing the cotangents."""
        return self._replay("split BW", s, self._fused_grad)(self.cast(s, p), res, g)

    def _fused_grad(self, s: int, p: Any, res: Residuals, g: Any) -> tuple[Any, Any]:
        dinput, cots = self._pull(s, p, res, g)
        operands, _ = self.w_spec.unpack(s, res.w)
        return self.splitters[s].weight_grads(p, operands, cots), dinput

    def residual_bytes(self, s: int) -> dict[str, int]:
        """Bytes of one microbatch's stored buffers of stage s, by role: `b` (vjp
        residuals), `w_operands` (stored at F for W) and `cotangents` (written by
        B for W); a stage that is not split stores only `b`."""
        nbytes = lambda avals: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(avals))  # noqa: E731
        if s not in self.split:
            return {"b": nbytes(self.w_spec.avals[s]), "w_operands": 0, "cotangents": 0}
        b = nbytes(self.b_spec.avals[s])
        operands, cots = jax.tree.unflatten(self.w_spec.treedefs[s], self.w_spec.avals[s])
        return {"b": b, "w_operands": nbytes(operands), "cotangents": nbytes(cots)}

    def region_bytes(self, s: int) -> int:
        """Bytes of the residuals of stage s's largest checkpointed region (the model's
        own remat, remat_regions.py), which its backward recomputes one at a time."""
        return region_residual_bytes(self.fns[s], self.compute_avals(s), self.act_avals[s])

    def stored_bytes(self, s: int) -> StoredBytes:
        """Stage s's bytes per microbatch by the op that frees them (ir/memory.py):
        a split stage's B-pool row until B, W operands until W, cotangents from B
        to W; any other stage's row until its last backward op."""
        got = self.residual_bytes(s)
        if s not in self.split:
            return StoredBytes(until_b=0, until_w=got["b"])
        return StoredBytes(got["b"], got["w_operands"], got["cotangents"])
