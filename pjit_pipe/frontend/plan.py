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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjit_pipe.errors import MeshError, OptionError
from pjit_pipe.frontend.cut import layer_cut
from pjit_pipe.frontend.measure import segment_times
from pjit_pipe.frontend.mesh import make_mesh
from pjit_pipe.planner import CostModel, Devices, Plan, Profile, cluster, plan_model

MS = 1e3


def _bytes(avals: Any) -> float:
    return float(
        sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(avals))
    )


def profile_model(module: Any, variables: Any, x_mb: Any) -> Profile:
    """The planner's profile of `module` for one microbatch like `x_mb` (times in ms,
    measured on the default device; compiles one program per layer)."""
    cut = layer_cut(module, variables, x_mb)
    is_aval = lambda a: isinstance(a, jax.ShapeDtypeStruct)  # noqa: E731
    params = cut.split(cut.model.variables(cut.param_avals), is_aval)
    third = MS / 3 * np.array(segment_times(cut.stage_fns(), params, cut.x_aval))
    outs, act = [], cut.x_aval
    for fn, p in zip(cut.stage_fns(), params, strict=True):
        act = jax.eval_shape(fn, p, act)
        outs.append(_bytes(act))
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
    """The planner's best plan for `module` at `microbatches` per replica, from its
    profile on microbatches like `x_mb`. `devices`: the planner's device description
    (default: the local devices, one node with 150 GB/s links and 32 GB each); the
    plan's device ids index `jax.devices()`. stages, replicas, schedule: fixed, or
    chosen by the planner when None."""
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
            f"plan: expected a pjit_pipe.planner.Plan (from pjit_pipe.plan_pipeline or "
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
    if mesh is None:
        mesh = make_mesh(mapping=plan.mapping)
    elif dict(mesh.shape) != {"data": plan.replicas, "stage": plan.num_stages}:
        raise MeshError(
            f"mesh: its shape {dict(mesh.shape)} differs from the plan's "
            f"{plan.replicas} x {plan.num_stages}; leave it out (the plan's mapping makes it)"
        )
    return plan.num_stages, plan.schedule, mesh
