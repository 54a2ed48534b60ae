"""The pipeline planner: cut a profiled model into stages and map them onto devices.

After Luo et al., "Efficient Pipeline Planning for Expedited Distributed DNN
Training" (INFOCOM'22): a partition DP with a device-mapping search
(`search`), checked by an exhaustive engine on small instances (`exact`),
both pricing plans with the event simulator (`cost`).
"""

from __future__ import annotations

import math

from pjit_pipe.planner.cost import (
    PLANNABLE_KINDS,
    CostModel,
    Evaluation,
    Plan,
    PlanError,
)
from pjit_pipe.planner.devices import (
    Devices,
    DevicesError,
    cluster,
    devices_from_json,
    load_devices,
)
from pjit_pipe.planner.memory_bound import smallest_memory
from pjit_pipe.planner.profile import (
    Profile,
    ProfileError,
    load_profile,
    parse_profile,
    shipped_profile,
)
from pjit_pipe.planner.search import Searcher


def plan_model(
    model: CostModel,
    stages: int | None = None,
    replicas: int | None = None,
    schedule: str | None = None,
) -> Evaluation:
    """The fast planner's best plan; PlanError naming the least memory needed if none fits."""
    try:
        return Searcher(model).search(stages, replicas, schedule)
    except PlanError:
        kinds = [schedule] if schedule else list(PLANNABLE_KINDS)
        need, P, kind = smallest_memory(model, stages, replicas, kinds)
        held = float(model.devices.memory.max())
        raise PlanError(
            f"no plan fits in memory: the smallest any plan needs is {math.ceil(need)} bytes "
            f"({need / 1e9:.3g} GB) on its fullest device ({P} stages, {kind}), but the "
            f"largest device holds {held:.0f} bytes ({held / 1e9:.3g} GB)"
        ) from None


__all__ = [
    "PLANNABLE_KINDS",
    "CostModel",
    "Devices",
    "DevicesError",
    "Evaluation",
    "Plan",
    "PlanError",
    "Profile",
    "ProfileError",
    "Searcher",
    "cluster",
    "devices_from_json",
    "draw_plan",
    "load_devices",
    "load_profile",
    "parse_profile",
    "plan_model",
    "probe_devices",
    "shipped_profile",
    "smallest_memory",
]

# Drawing needs matplotlib and probing needs JAX: loaded on first use (PEP 562),
# so that planning imports neither.
_LAZY = {
    "probe_devices": "pjit_pipe.planner.device_probe",
    "draw_plan": "pjit_pipe.planner.plan_chart",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
