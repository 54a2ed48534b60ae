"""Split a stage's backward into B (input gradient) and W (weight gradient) that cost BW together.

Reverse mode through a stage computes two things: the cotangent of every
intermediate value (the chain that ends in the input gradient) and, at each op
that reads a parameter, that op's parameter cotangent. Only the second part can
wait. If W simply re-ran the stage's pullback for the parameter gradients, it
would re-run the whole chain too, and B + W would cost about twice BW.

So we cut the stage's jaxpr (`make_jaxpr`, with nested `jit`/`checkpoint`
calls inlined) at its *sites*: the equations that read both a value derived
from the parameters alone ("param" values: the weights, their transposes,
casts and broadcasts) and a value derived from the stage input or labels
("data" values). Every parameter reaches the stage output only through a site,
so the parameter gradient is the sum over sites of the site's own vjp with
respect to its param operands, applied to the cotangent of the site's output,
then pulled back through the cheap param-only chain.

- F runs the stage forward (as an interpreter over the flat jaxpr) with a
  zero-valued *perturbation* added to each site's output (an elementwise
  site's param operand, below), and keeps, besides
  the usual vjp residuals, the data operands that the sites' vjps read
  (a dense layer's input; nothing for a bias add).
- B takes the vjp with respect to (stage input, perturbations) only. The
  parameters are constants there, so no weight-gradient contraction is ever
  built, and the perturbations' cotangents are the sites' output cotangents,
  which B stores.
- W evaluates only the param-only chain, then for each site transposes the
  site with its stored data operands fixed (one `dot_general` per dense
  weight, contracted so that it yields the weight's own layout:
  `_dot_weight_grad`; a scatter-add for an embedding gather), takes the parameter-sized
  cotangents B stored for elementwise sites (below) as they are, sums the
  contributions of a parameter read twice, and pulls them back through the
  param-only chain (`jax.vjp` of that chain).

An *elementwise* site (a binary `mul`, `add`, `sub`, `div`, `max` or `min`
of one param and one data operand: a bias add, a norm's scale, `x / w`) is
perturbed at its param operand instead of its output, so B's vjp yields that
operand's cotangent directly: the site's transpose, reduced over the
broadcast axes (`sum(dy)` for a bias, `sum(dy * xhat)` for a norm scale).
This is parameter-sized where the output cotangent is activation-sized, and
XLA computes it inside the fusion that produces dy, so B writes a few bytes
instead of a full-size cotangent, W neither stores nor reads that site's data
operand, and W does not re-read a matmul's cotangent for its bias. It is
clean because it is exact and cheap: no contraction and no input-gradient
work moves into B (its only extra work is one multiply-and-reduce per site,
which XLA fuses), and W's contractions stay one per weight matmul. Sites
with a contraction or a lookup (`dot_general`, `conv`, `gather`) stay in W:
their parameter cotangent would cost B a weight-gradient contraction (or a
table-sized scatter).

Random numbers (dropout): a stage function reads its microbatch's keys
from a context variable (rng.py), so a jaxpr traced once would hold the
keys it was traced with as constants. The keys are therefore explicit data
inputs of the traced jaxpr, and F's interpreter feeds it the keys of the
microbatch it runs; W never draws (what it needs of a random mask is a
stored data operand like any other).

A site that is not linear in its param operands (e.g. a `custom_jvp_call`
or loop that reads a parameter) is handled by `jax.vjp` of that one
equation, with all its data operands stored: correct, and only as costly as
that equation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pjit_pipe.lowering.compute.flat_jaxpr import Lit, bind, flatten
from pjit_pipe.lowering.compute.rng import active_key_data, microbatch_rngs

CONST, PARAM, DATA = 0, 1, 2

# Equations jointly linear in their param operands once the data operands are
# fixed: W transposes them instead of taking a vjp (no primal recomputation).
_LINEAR = {
    "dot_general",
    "gather",
    "dynamic_slice",
    "concatenate",
    "conv_general_dilated",
    "reduce_sum",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "convert_element_type",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
}
# Linear sites whose transpose does not read their data operands.
_NO_DATA = {"concatenate"}
# Elementwise binary sites (one param operand, one data operand, no contraction):
# B takes their param operand's cotangent itself (see the module docstring), so
# W never transposes them.
_ELEMENTWISE = {"mul", "add", "add_any", "sub", "div", "max", "min"}


@dataclass(frozen=True)
class _Site:
    index: int  # position in the flat equation list
    cot: tuple[int | None, ...]  # per result: its perturbation number (None: no cotangent);
    #                              for an `at_param` site, the one of its param operand
    linear: bool
    at_param: bool = False  # perturbed at its param operand: B stores that operand's cotangent


@jax.custom_jvp
def _perturb(x: jax.Array, eps: jax.Array) -> jax.Array:
    """x, whose tangent also carries eps's: the zero perturbation of a site's
    output (or of an elementwise site's param operand).

    Unlike `x + eps`, the primal never reads eps, so a checkpointed forward
    does not keep the (zero) perturbations as residuals."""
    return x


@_perturb.defjvp
def _perturb_jvp(primals, tangents):
    return primals[0], tangents[0] + tangents[1]


def _struct(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _inexact(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _dot_weight_grad(eqn: Any, data: jax.Array, ct: jax.Array, param_side: int) -> jax.Array:
    """The cotangent of a `dot_general`'s param operand (`param_side` 0: lhs, 1: rhs)
    given its data operand and the output cotangent `ct`.

    JAX's transpose rule contracts ct with the data operand in the order (ct,
    data) and then transposes the result into the param's layout; in W, where ct
    is read from the W-pool rather than produced in the same program, XLA's CPU
    backend turns that transpose into a copy of ct for every weight (a third of
    W's time on a GPT block stage). Contracting in the order (data, ct) for an rhs
    param and (ct, data) for an lhs param yields the param's own dimension order
    whenever its contracting dimensions are in the data operand's order (a
    Dense kernel, every projection of an attention block), so no transpose is
    left; where they are not, the one transpose left is the rule's own.
    """
    (lhs_c, rhs_c), (lhs_b, rhs_b) = eqn.params["dimension_numbers"]
    param_c, param_b = (lhs_c, lhs_b) if param_side == 0 else (rhs_c, rhs_b)
    data_c, data_b = (rhs_c, rhs_b) if param_side == 0 else (lhs_c, lhs_b)
    param_rank = len(eqn.invars[param_side].aval.shape)
    data_free = [d for d in range(data.ndim) if d not in data_c and d not in data_b]
    param_free = [d for d in range(param_rank) if d not in param_c and d not in param_b]
    nb = len(data_b)
    # ct's dimensions: the batch ones, lhs's free ones, rhs's free ones.
    first = nb if param_side == 1 else nb + len(param_free)
    ct_data_free = list(range(first, first + len(data_free)))
    dot = lambda a, b, dims: jax.lax.dot_general(  # noqa: E731
        a,
        b,
        dims,
        precision=eqn.params.get("precision"),
        preferred_element_type=eqn.params.get("preferred_element_type"),
    )
    batch = list(range(nb))
    kept_c = sorted(data_c)  # the data operand's contracting dims, in its order
    param_of_c = [param_c[list(data_c).index(d)] for d in kept_c]
    if param_side == 1:  # result: batch, data's contracting dims, ct's param-free dims
        out = dot(data, ct, ((data_free, ct_data_free), (list(data_b), batch)))
        dims = [*param_b, *param_of_c, *param_free]
    else:  # result: batch, ct's param-free dims, data's contracting dims
        out = dot(ct, data, ((ct_data_free, data_free), (batch, list(data_b))))
        dims = [*param_b, *param_free, *param_of_c]
    if dims != list(range(param_rank)):
        out = jax.lax.transpose(out, [dims.index(d) for d in range(param_rank)])
    return out.astype(eqn.invars[param_side].aval.dtype)


class SplitBackward:
    """The site analysis of one stage `fn(params, act, labels) -> out` and its split passes.

    `perturbations` are the avals of the per-site zero inputs of `forward`;
    `stored` the avals of the data operands F keeps for W.
    """

    def __init__(self, fn: Callable, params: Any, act: Any, labels: Any):
        # The keys of the microbatch being traced, if the lowering runs with rngs:
        # explicit inputs (see the module docstring).
        active = active_key_data()
        self.keyed = active is not None

        def traced(p, a, y, keys):
            if not self.keyed:
                return fn(p, a, y)
            with microbatch_rngs(keys, active[1]):
                return fn(p, a, y)

        keys = active[0] if self.keyed else {}
        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(params, act, labels, keys)
        self.out_tree = jax.tree.structure(out_shape)
        self.param_tree = jax.tree.structure(params)
        self.eqns, inputs, self.outputs, self.avals = flatten(closed)
        n_p, n_a = len(jax.tree.leaves(params)), len(jax.tree.leaves(act))
        self.param_ids, self.data_ids = inputs[:n_p], inputs[n_p:]
        self.act_count = n_a
        cls: dict[int, int] = {i: PARAM for i in self.param_ids}
        cls.update({i: DATA for i in self.data_ids})
        of = lambda v: CONST if isinstance(v, Lit) else cls[v]  # noqa: E731
        site_eqns: list[int] = []
        for k, e in enumerate(self.eqns):
            kinds = {of(v) for v in e.ins}
            out_cls = DATA if DATA in kinds else PARAM if PARAM in kinds else CONST
            if kinds >= {DATA, PARAM} and any(_inexact(self.avals[o]) for o in e.outs):
                site_eqns.append(k)
            cls.update({o: out_cls for o in e.outs})
        self.cls = cls
        self._assign(site_eqns, of)

    def _assign(self, site_eqns: list[int], of: Callable[[Any], int]) -> None:
        """Perturbation numbers (at the param operand of elementwise sites, at the
        outputs of the others) and the data operands W needs."""
        self.perturbations: list[Any] = []
        number: dict[int, tuple[int | None, ...]] = {}
        self._eps_at: dict[int, tuple[int | None, ...]] = {}  # equation -> what F adds
        self._eps_in: dict[int, tuple[int, int]] = {}  # equation -> (param slot, number)
        at_param = set()
        for k in site_eqns:
            slot = self._param_slot(k, of)
            if slot is not None:
                at_param.add(k)
                number[k] = (len(self.perturbations),)
                self._eps_in[k] = (slot, len(self.perturbations))
                self.perturbations.append(_struct(self.avals[self.eqns[k].ins[slot]]))
                continue
            cots = []
            for o in self.eqns[k].outs:
                if _inexact(self.avals[o]):
                    cots.append(len(self.perturbations))
                    self.perturbations.append(_struct(self.avals[o]))
                else:
                    cots.append(None)
            number[k] = self._eps_at[k] = tuple(cots)
        self.sites = []
        stored: dict[int, None] = {}
        self.param_operands: dict[int, None] = {}
        for k in site_eqns:
            e = self.eqns[k]
            name = e.eqn.primitive.name
            linear = name in _LINEAR and not (name == "select_n" and of(e.ins[0]) == PARAM)
            self.sites.append(_Site(k, number[k], linear, k in at_param))
            for v in e.ins:
                if of(v) == DATA and k not in at_param and not (linear and name in _NO_DATA):
                    stored[v] = None
                elif of(v) == PARAM:
                    self.param_operands[v] = None
        # Outputs that are param-only values (e.g. a stage returning a weight).
        self.direct = []
        for i, v in enumerate(self.outputs):
            if not isinstance(v, Lit) and self.cls[v] == PARAM and _inexact(self.avals[v]):
                self.direct.append((i, v, len(self.perturbations)))
                self.perturbations.append(_struct(self.avals[v]))
                self.param_operands[v] = None
        self.stored_ids = list(stored)
        self.stored = [_struct(self.avals[v]) for v in self.stored_ids]

    def _param_slot(self, k: int, of: Callable[[Any], int]) -> int | None:
        """The param operand's position if site k is perturbed there (an elementwise
        binary op of one param and one data operand), else None."""
        e = self.eqns[k]
        if e.eqn.primitive.name not in _ELEMENTWISE or len(e.ins) != 2 or len(e.outs) != 1:
            return None
        kinds = [of(v) for v in e.ins]
        if sorted(kinds) != [PARAM, DATA] or not _inexact(self.avals[e.ins[kinds.index(PARAM)]]):
            return None
        return kinds.index(PARAM)

    def zero_perturbations(self) -> list[jax.Array]:
        return [jnp.zeros(a.shape, a.dtype) for a in self.perturbations]

    # ---- F: the forward with perturbations, keeping W's data operands ----

    def forward(self, params: Any, act: Any, labels: Any, eps: Sequence[jax.Array]):
        """(stage output, data operands W needs); `eps` are added at the site outputs.
        A stage traced with keys reads those of the microbatch being traced now."""
        keys = {}
        if self.keyed:
            active = active_key_data()
            if active is None:
                raise RuntimeError("a stage traced with rngs runs outside microbatch_rngs")
            keys = active[0]
        env = dict(zip(self.param_ids, jax.tree.leaves(params), strict=True))
        env.update(zip(self.data_ids, jax.tree.leaves((act, labels, keys)), strict=True))
        read = lambda v: v.value if isinstance(v, Lit) else env[v]  # noqa: E731
        for k, e in enumerate(self.eqns):
            args = [read(v) for v in e.ins]
            if k in self._eps_in:
                slot, n = self._eps_in[k]
                args[slot] = _perturb(args[slot], eps[n])
            outs = bind(e.eqn, args)
            added = self._eps_at.get(k, (None,) * len(outs))
            for o, val, n in zip(e.outs, outs, added, strict=True):
                env[o] = val if n is None else _perturb(val, eps[n])
        outs = [read(v) for v in self.outputs]
        for i, _, n in self.direct:
            outs[i] = _perturb(outs[i], eps[n])
        return jax.tree.unflatten(self.out_tree, outs), [env[v] for v in self.stored_ids]

    # ---- W: parameter gradients from stored data operands and site cotangents ----

    def _param_chain(self, params: Any) -> dict[int, Any]:
        """Values of every const and param-only equation (no data equation runs)."""
        env = dict(zip(self.param_ids, jax.tree.leaves(params), strict=True))
        read = lambda v: v.value if isinstance(v, Lit) else env[v]  # noqa: E731
        for e in self.eqns:
            if all(isinstance(v, Lit) or self.cls[v] != DATA for v in e.ins):
                for o, val in zip(e.outs, bind(e.eqn, [read(v) for v in e.ins]), strict=True):
                    env[o] = val
        return env

    def weight_grads(
        self, params: Any, stored: Sequence[jax.Array], cots: Sequence[jax.Array]
    ) -> Any:
        """The stage's parameter gradient (a tree like `params`)."""
        wanted = list(self.param_operands)

        def chain(params):
            env = self._param_chain(params)
            return [env[v] for v in wanted]

        values, pull = jax.vjp(chain, params)
        env = self._param_chain(jax.tree.map(jax.lax.stop_gradient, params))
        env.update(zip(wanted, values, strict=True))
        env.update(zip(self.stored_ids, stored, strict=True))
        acc: dict[int, jax.Array] = {}

        def add(v: int, ct: Any) -> None:
            acc[v] = ct if v not in acc else acc[v] + ct

        for site in self.sites:
            e = self.eqns[site.index]
            if site.at_param:  # B took this operand's cotangent
                add(e.ins[self._eps_in[site.index][0]], cots[site.cot[0]])
                continue
            slots = [
                i for i, v in enumerate(e.ins) if not isinstance(v, Lit) and self.cls[v] == PARAM
            ]
            args = []
            for v in e.ins:
                if isinstance(v, Lit):
                    args.append(v.value)
                elif v in env:
                    args.append(env[v])
                else:  # a data operand the transpose does not read
                    args.append(jnp.zeros(self.avals[v].shape, self.avals[v].dtype))

            def site_fn(*ps, e=e, args=args, slots=slots):
                full = list(args)
                for i, p in zip(slots, ps, strict=True):
                    full[i] = p
                return bind(e.eqn, full)

            out_cts = [
                cots[n] if n is not None else jnp.zeros(self.avals[o].shape, self.avals[o].dtype)
                for n, o in zip(site.cot, e.outs, strict=True)
            ]
            primals = [args[i] for i in slots]
            if e.eqn.primitive.name == "dot_general" and len(slots) == 1:
                data_side = 1 - slots[0]
                add(e.ins[slots[0]], _dot_weight_grad(e.eqn, args[data_side], out_cts[0], slots[0]))
                continue
            if site.linear:
                cts = jax.linear_transpose(site_fn, *primals)(out_cts)
            else:
                cts = jax.vjp(site_fn, *primals)[1](out_cts)
            for i, ct in zip(slots, cts, strict=True):
                add(e.ins[i], ct)
        for _, v, n in self.direct:
            add(v, cots[n])
        zeros = [jnp.zeros(self.avals[v].shape, self.avals[v].dtype) for v in wanted]
        (grads,) = pull([acc.get(v, z) for v, z in zip(wanted, zeros, strict=True)])
        return grads
