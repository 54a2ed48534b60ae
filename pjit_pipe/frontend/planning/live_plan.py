"""The planner (pjit_pipe.planner) on a live Flax model: profile its layers, plan, apply.

The planner's layers are the model's clean cut segments (`cut.layer_cut`):
the code between two cut points the stage cutter may use. `profile_model`
times each one's forward + backward (`jax.vjp`, as `balance="time"` does:
one compile per layer) on the default device and splits it F = B = W = a
third (a backward costs about two forwards, B and W one each), and takes
the bytes of the activation it hands on and of the parameters it reads,
giving a `planner.Profile`.
`plan_pipeline` runs the planner on it. The resulting `Plan` goes to
`pipeline(..., plan=plan)`: its layer ranges become the stage cut, its
D x P device mapping the mesh, its kind the schedule (`planned_options`).

`auto_plan` is what `pipeline(..., plan="auto")` runs at first use, when the
global batch is known (`frontend/planning/auto_plan.py`). The global batch B is fixed,
so the replica count D sets the microbatch (B / (D m) rows): it profiles the
layers once, at the smallest allowed D's microbatch, and prices each allowed D
with that profile scaled to its microbatch (times and activation bytes in
proportion to the rows, parameters unchanged: an assumption, linear in the
batch), planning each D with the planner and keeping the least period (one
step processes the same B samples whatever D is). The devices are the mesh's
(or all local ones), measured by `planner.probe.probe_devices` once per
device set and process.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjit_pipe.errors import BatchError, MeshError, OptionError
from pjit_pipe.frontend.cutter.cut import layer_cut
from pjit_pipe.frontend.mesh import make_mesh, tensor_size, worker_devices
from pjit_pipe.frontend.planning.measure import segment_times
from pjit_pipe.planner import (
    CostModel,
    Devices,
    Evaluation,
    Plan,
    PlanError,
    Profile,
    cluster,
    plan_model,
    probe_devices,
)

MS = 1e3
# An equation of a jaxpr's text whose every output is unused (`_`): tracing the
# same block twice can leave such a dead op in one copy and not the other.
_DEAD = re.compile(r"^\s*(?:_:\S+\s+)+=.*$\n?", re.M)


def _bytes(avals: Any) -> float:
    return float(
        sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(avals))
    )


def profile_model(module: Any, variables: Any, x_mb: Any) -> Profile:
    """The planner's profile of `module` for one microbatch like `x_mb` (times in ms,
    measured on the default device; compiles one program per distinct layer: layers
    with the same jaxpr on the same shapes, such as a model's repeated blocks, are
    timed once)."""
    cut = layer_cut(module, variables, x_mb)
    is_aval = lambda a: isinstance(a, jax.ShapeDtypeStruct)  # noqa: E731
    params = cut.split(cut.model.variables(cut.param_avals), is_aval)
    fns = cut.stage_fns()
    outs, ins, kinds, act = [], [], [], cut.x_aval
    for fn, p in zip(fns, params, strict=True):
        ins.append(act)
        kinds.append(_DEAD.sub("", str(jax.make_jaxpr(fn)(p, act))))  # shapes are in the text
        act = jax.eval_shape(fn, p, act)
        outs.append(_bytes(act))
    first = {kind: k for k, kind in reversed(list(enumerate(kinds)))}
    seconds = {k: segment_times([fns[k]], [params[k]], ins[k])[0] for k in sorted(first.values())}
    third = MS / 3 * np.array([seconds[first[kind]] for kind in kinds])
    n = cut.stages
    return Profile(
        names=tuple(", ".join(cut.stage_names(k)) or f"glue {k}" for k in range(n)),
        f=third,
        b=third,
        w=third,
        act_bytes=np.array(outs),
        param_bytes=np.array([float(cut.param_bytes(k)) for k in range(n)]),
        edges=tuple((k, k + 1) for k in range(n - 1)),
    )


def plan_pipeline(
    module: Any,
    variables: Any,
    x_mb: Any,
    microbatches: int,
    devices: Devices | None = None,
    stages: int | None = None,
    replicas: int | None = None,
    schedule: str | None = None,
) -> Plan:
    """The planner's best plan for `module` at `microbatches` per replica.

    Profiles the model's layers (its clean cut segments) on microbatches like
    `x_mb` (`profile_model`: one compile per distinct layer, on the default
    device), then runs the planner on that profile. Give the plan to
    `pipeline(..., plan=plan)`.

    Args:
        module: A linen or NNX Module instance.
        variables: Its parameters.
        x_mb: One microbatch of model input (arrays, or a pytree of them).
        microbatches: m, microbatches per data replica per step.
        devices: The planner's device description (default: the local
            devices, one node with 150 GB/s links and 32 GB each).
        stages: Fixed P, or None for the planner to choose.
        replicas: Fixed D, or None for the planner to choose.
        schedule: A fixed kind the planner plans (`planner.PLANNABLE_KINDS`),
            or None for the planner to choose.

    Returns:
        The best Plan found: layer ranges per stage, the D x P device mapping
        (ids index `jax.devices()`) and the schedule kind.

    Raises:
        CutError: The model runs inside a Flax transform applied to its root
            module, which hides its layers from the cutter.
        PlanError: No plan fits the devices' memory (the message names the
            least memory any plan needs).
    """
    if devices is None:
        devices = cluster(1, len(jax.devices()))
    profile = profile_model(module, variables, x_mb)
    return plan_model(CostModel(profile, devices, microbatches), stages, replicas, schedule).plan


def planned_options(
    plan: Plan, stages: int | None, schedule: str | None, mesh: Mesh | None
) -> tuple[int, str, Mesh]:
    """(stages, schedule, mesh) of a pipeline run by `plan`; options the caller also
    gave must agree with it."""
    if not isinstance(plan, Plan):
        raise OptionError(
            f"plan: expected 'auto' or a pjit_pipe.planner.Plan (from pjit_pipe.plan_pipeline or "
            f"the planner), got {type(plan).__name__}"
        )
    for name, given, planned in (
        ("stages", stages, plan.num_stages),
        ("schedule", schedule, plan.schedule),
    ):
        if given is not None and given != planned:
            raise OptionError(
                f"{name}: {given!r} differs from the plan's {planned!r}; leave it out"
            )
    planned = make_mesh(mapping=plan.mapping)
    if mesh is None:
        return plan.num_stages, plan.schedule, planned
    if (mesh.shape["data"], mesh.shape["stage"], tensor_size(mesh)) != (
        plan.replicas,
        plan.num_stages,
        1,
    ):
        raise MeshError(
            f"mesh: its shape {dict(mesh.shape)} differs from the plan's "
            f"{plan.replicas} x {plan.num_stages}; leave it out (the plan's mapping makes it)"
        )
    if worker_devices(mesh).tolist() != planned.devices.tolist():
        ids = lambda m: [[d.id for d in row] for row in worker_devices(m)[..., 0].tolist()]  # noqa: E731
        raise MeshError(
            f"mesh: its devices {ids(mesh)} differ from the plan's mapping {ids(planned)} "
            "(device ids); leave mesh out (the plan's mapping makes it)"
        )
    return plan.num_stages, plan.schedule, mesh


def scaled(profile: Profile, factor: float) -> Profile:
    """`profile` for microbatches of `factor` times the rows: times and activation
    bytes scale with the rows, parameter bytes do not."""
    return dataclasses.replace(
        profile,
        f=profile.f * factor,
        b=profile.b * factor,
        w=profile.w * factor,
        act_bytes=profile.act_bytes * factor,
    )


@functools.cache
def _probed(devices: tuple[jax.Device, ...]) -> Devices:
    return probe_devices(devices)


@dataclass(frozen=True)
class AutoPlan:
    """What `plan="auto"` chose and from what (see the module docstring).

    evaluation: the planner's best plan (device ids index `pool`), its period
    (ms per step) and memory (bytes per device of `pool`). profile: the layers
    profiled at `rows` rows per microbatch (the first of `periods`' replica
    counts); devices: the measured description of `pool`. periods: per replica
    count D tried, the best period (ms), or None where no plan fits memory.
    """

    evaluation: Evaluation
    profile: Profile
    rows: int
    devices: Devices
    pool: tuple[jax.Device, ...]
    periods: dict[int, float | None]

    @property
    def plan(self) -> Plan:
        """The chosen plan with its mapping as indices into `jax.devices()`, as
        `pipeline(plan=...)` and `make_mesh(mapping=...)` take it."""
        index = {d: k for k, d in enumerate(jax.devices())}
        raw = self.evaluation.plan
        mapping = tuple(tuple(index[self.pool[d]] for d in row) for row in raw.mapping)
        return Plan(raw.stages, mapping, raw.schedule)

    def describe(self) -> str:
        """The plan and the alternatives it beat, as text."""
        plan, ev = self.plan, self.evaluation
        tried = ", ".join(
            f"D={d}: {'no fit' if p is None else f'{p:.3f} ms'}" for d, p in self.periods.items()
        )
        lines = [
            f"plan='auto': {plan.replicas} x {plan.num_stages} (data x stage), {plan.schedule}, "
            f"planned period {ev.period:.3f} ms per step ({tried})"
        ]
        for p, (first, last) in enumerate(plan.stages):
            names = ", ".join(self.profile.names[first : last + 1])
            devs = ", ".join(str(row[p]) for row in plan.mapping)
            lines.append(f"  stage {p}: layers {first}-{last} ({names}) on devices {devs}")
        return "\n".join(lines)


def auto_plan(
    module: Any,
    variables: Any,
    x: Any,
    microbatches: int,
    pool: Sequence[jax.Device],
    stages: int | None = None,
    replicas: int | None = None,
    schedule: str | None = None,
) -> AutoPlan:
    """The plan for `module` on global batches like `x` over the devices `pool`
    (see the module docstring); stages, replicas, schedule: fixed, or chosen when None."""
    pool = tuple(pool)
    batch = int(np.shape(jax.tree.leaves(x)[0])[0])
    counts = [replicas] if replicas else range(1, len(pool) + 1)
    counts = [
        d for d in counts if batch % (d * microbatches) == 0 and d * (stages or 1) <= len(pool)
    ]
    if not counts:
        fixed = f"data={replicas} x " if replicas else "D x "
        raise BatchError(
            f"x: global batch {batch} is not divisible by {fixed}microbatches={microbatches} "
            f"for any replica count D the devices allow; use a multiple of "
            f"{(replicas or 1) * microbatches}"
        )
    rows = batch // (counts[0] * microbatches)
    profile = profile_model(module, variables, jax.tree.map(lambda a: a[:rows], x))
    devices = _probed(pool)
    periods: dict[int, float | None] = {}
    best: Evaluation | None = None
    failure: PlanError | None = None
    for d in counts:
        model = CostModel(scaled(profile, counts[0] / d), devices, microbatches)
        try:
            ev = plan_model(model, stages, d, schedule)
        except PlanError as e:
            periods[d], failure = None, failure or e
            continue
        periods[d] = ev.period
        if best is None or ev.period < best.period:
            best = ev
    if best is None:
        assert failure is not None
        raise failure
    return AutoPlan(best, profile, rows, devices, pool, periods)
