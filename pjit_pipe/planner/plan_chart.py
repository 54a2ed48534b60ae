"""Draw a plan: the device graph with its stages placed on it, next to the Gantt chart.

Left: every device on a circle, each link drawn as a line whose width and
shade grow with its bandwidth (the slower direction), the links the plan
sends activations over in red; a device is filled with its stage's colour and
labelled with its stage and replica. Right: the event simulation of one
iteration of the plan (pjit_pipe.simulator.charts), times in ms.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from matplotlib import colormaps, rc_context
from matplotlib.figure import Figure

from pjit_pipe.errors import PlotError
from pjit_pipe.planner.cost import CostModel, Plan
from pjit_pipe.simulator import SUFFIXES, draw_gantt


def _device_graph(ax, model: CostModel, plan: Plan) -> None:
    n = len(model.devices)
    angle = 2 * np.pi * np.arange(n) / n
    xy = np.stack([np.cos(angle), np.sin(angle)], axis=1)
    bw = model.devices.bandwidth
    slower = np.minimum(bw, bw.T)
    finite = slower[np.isfinite(slower)]
    lo, hi = (finite.min(), finite.max()) if finite.size else (1.0, 1.0)
    for i in range(n):
        for j in range(i + 1, n):
            rel = 1.0 if hi == lo else (np.log(slower[i, j]) - np.log(lo)) / np.log(hi / lo)
            ax.plot(*xy[[i, j]].T, color=str(0.85 - 0.6 * rel), linewidth=0.5 + 2.5 * rel, zorder=1)
    for row in plan.mapping:
        for a, b in itertools.pairwise(row):
            ax.annotate(
                "",
                xy=xy[b],
                xytext=xy[a],
                arrowprops={"arrowstyle": "->", "color": "#d62728", "linewidth": 2},
                zorder=2,
            )
    colors = colormaps["tab20"]
    place = {d: (r, p) for r, row in enumerate(plan.mapping) for p, d in enumerate(row)}
    for d in range(n):
        r, p = place.get(d, (None, None))
        face = colors(p % 20) if p is not None else "white"
        ax.scatter(*xy[d], s=900, color=face, edgecolors="black", zorder=3)
        label = f"d{d}" if p is None else f"d{d}\nS{p} r{r}"
        ax.text(*xy[d], label, ha="center", va="center", fontsize=7, zorder=4)
    ax.set_aspect("equal")
    ax.set_xlim(-1.3, 1.3)
    ax.set_ylim(-1.3, 1.3)
    ax.axis("off")
    spans = ", ".join(f"S{p}: {a}-{b}" for p, (a, b) in enumerate(plan.stages))
    ax.set_title(f"devices (red: pipeline links)\nlayers {spans}", fontsize=9)


def draw_plan(model: CostModel, plan: Plan, path: str | Path) -> Path:
    """Write the device graph and the Gantt chart of `plan` to `path` (.png or .svg)."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise PlotError(f"--plot: write the plan as .png or .svg, got {str(path)!r}")
    result = model.simulate(plan, iterations=1)
    workers = plan.replicas * plan.num_stages
    gantt_width = 10.0
    fig = Figure(figsize=(6 + gantt_width, max(6.0, 0.55 * workers + 1.6)), layout="constrained")
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [6, gantt_width]})
    _device_graph(left, model, plan)
    draw_gantt(right, result, f"{plan.schedule} (ms)", gantt_width)
    with rc_context({"svg.fonttype": "none"}):
        fig.savefig(path, dpi=100)
    return path
