"""Gantt charts of simulated schedules (PNG or SVG), one row per worker.

Boxes are coloured by op kind and carry their microbatch number; white space is
bubble. Built on a bare matplotlib Figure (no pyplot state), so it works
headless and from threads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pjit_pipe.errors import PlotError
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import COMPUTE_KINDS, Kind, Worker
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.simulator.simulate import SimResult, simulate

COLORS = {
    Kind.F: "#4e79a7",
    Kind.B: "#59a14f",
    Kind.W: "#f28e2b",
    Kind.BW: "#76b7b2",
    Kind.OPT: "#e15759",
    Kind.SEND: "#7f7f7f",
    Kind.RECV: "#bab0ac",
}
SUFFIXES = (".png", ".svg")
_LABEL_PT_PER_CHAR = 6.5


def _title(kind: str, result: SimResult) -> str:
    return (
        f"{kind}   makespan {result.makespan:g}   bubble {result.bubble_ratio:.1%}"
        f"   peak memory {max(result.peak_memory.values(), default=0):g}"
    )


def draw_gantt(
    ax,
    result: SimResult,
    title: str,
    width: float,
    fused: frozenset = frozenset(),
    slow: Mapping[Worker, float] | None = None,
) -> None:
    """Draw `result`'s events on the matplotlib axes `ax` (`width`: the axes' inches,
    to decide which boxes have room for a label); the (worker, iteration, op) in
    `fused` are cross-hatched: ops a tick table runs as one program. Ops of a
    microbatch that runs away from its home replica (re-routed from a failed or
    slow worker) are hatched; `slow` workers' rows say their factor."""
    slow = slow or {}
    workers = sorted(result.busy)
    row = {w: i for i, w in enumerate(workers)}
    end = max((e.end for e in result.events), default=1.0) or 1.0
    points_per_unit = (width - 1.5) * 72 / end
    chunks_of = {
        w: sorted(
            {e.op.stage for e in result.events if e.worker == w and e.op.kind in COMPUTE_KINDS}
        )
        for w in workers
    }
    # Boxes of one look on one row go to matplotlib as one collection: a bar
    # each is several times slower to build and to render.
    boxes: dict[tuple, list[tuple[float, float]]] = defaultdict(list)  # look -> (start, length)
    marks: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))  # color -> (xs, ys)
    for e in result.events:
        y, color = row[e.worker], COLORS[e.op.kind]
        dur = e.end - e.start
        if dur <= 0:  # zero-cost comm/optimizer: a tick mark
            marks[color][0].append(e.start)
            marks[color][1].append(y)
            continue
        chunk = chunks_of[e.worker].index(e.op.stage) if e.op.stage in chunks_of[e.worker] else 0
        if (e.worker, e.iteration, e.op) in fused:
            hatch = "xx"
        elif e.op.replica != e.worker.replica:
            hatch = "//"
        else:
            hatch = None
        boxes[(y, color, 1.0 if chunk == 0 else 0.6, hatch)].append((e.start, dur))
        label = "" if e.op.kind is Kind.OPT else str(e.op.mb)
        if label and dur * points_per_unit >= _LABEL_PT_PER_CHAR * (len(label) + 0.5):
            ax.text(
                e.start + dur / 2, y, label, ha="center", va="center", fontsize=7, color="white"
            )
    for (y, color, alpha, hatch), spans in boxes.items():
        ax.broken_barh(
            spans,
            (y - 0.4, 0.8),
            facecolors=color,
            edgecolors="black",
            linewidth=0.4,
            alpha=alpha,
            hatch=hatch,
        )
    for color, (xs, ys) in marks.items():
        ax.vlines(xs, [y - 0.4 for y in ys], [y + 0.4 for y in ys], colors=color, linewidth=1.5)
    ax.set_yticks(
        range(len(workers)),
        [f"worker {w}" + (f" (x{slow[w]:g})" if w in slow else "") for w in workers],
    )
    ax.set_ylim(len(workers) - 0.5, -0.5)
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    kinds = [k for k in COLORS if any(e.op.kind is k for e in result.events)]
    handles = [Patch(color=COLORS[k], label=k.value) for k in kinds]
    if fused:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="xx", label="one op"))
    if any(e.op.kind in COMPUTE_KINDS and e.op.replica != e.worker.replica for e in result.events):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="moved"))
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(_title(title, result), fontsize=10)


def gantt(
    result_or_schedule: SimResult | Schedule,
    path: str | Path,
    costs: Costs | None = None,
    title: str | None = None,
) -> Path:
    """Draw the events of a simulation (a Schedule is simulated for one iteration first).

    `path` must end in .png or .svg; `title` replaces the schedule kind in the heading,
    which always shows makespan and bubble ratio. Slow workers of `costs` have
    their factor beside their row. Returns the written path.
    """
    if isinstance(result_or_schedule, Schedule):
        result = simulate(result_or_schedule, costs)
        kind = result_or_schedule.kind
    else:
        result = result_or_schedule
        kind = "schedule"
    return _chart(result, path, title or kind, slow=(costs or Costs()).factors())


def tick_gantt(
    table: PackedTicks,
    path: str | Path,
    costs: Costs | None = None,
    title: str | None = None,
) -> Path:
    """Draw the compiled program's tick table as it runs under `costs` (the
    simulator's lockstep mode): each tick a band between grey lines, lasting as
    long as its slowest worker; a loss-stage F and backward that the program runs
    as one op (`ir.ticks.fused_loss_ops`) are cross-hatched. `path`: .png or .svg."""
    result = simulate(
        table.schedule, costs or Costs(), table.iterations, mode="lockstep", ticks=table
    )
    tick_of = {(w, it, op): t for (w, it, op), (t, _) in table.placement().items()}
    starts: dict[int, float] = {}  # each tick's start: its first ops start there
    for e in result.events:
        t = tick_of[(e.worker, e.iteration, e.op)]
        starts[t] = min(starts.get(t, e.start), e.start)
    heading = f"{title or table.schedule.kind}, {len(table)} ticks ({', '.join(table.order)})"
    slow = (costs or Costs()).factors()
    return _chart(result, path, heading, table.fused_ops(), tuple(starts.values()), slow)


def _chart(
    result: SimResult,
    path: str | Path,
    heading: str,
    fused: frozenset = frozenset(),
    lines: tuple[float, ...] = (),
    slow: Mapping[Worker, float] | None = None,
) -> Path:
    """Write `result`'s chart to `path` (.png or .svg), with grey lines at `lines`."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise PlotError(f"path: a chart is written as .png or .svg, got {str(path)!r}")
    per_row = max((sum(e.worker == w for e in result.events) for w in result.busy), default=1)
    width = min(40.0, max(8.0, 0.32 * per_row + 2.5))
    fig = Figure(figsize=(width, 0.55 * len(result.busy) + 1.6), layout="constrained")
    ax = fig.add_subplot()
    for x in lines:
        ax.axvline(x, color="#bbbbbb", linewidth=0.6, zorder=0)
    draw_gantt(ax, result, heading, width, fused, slow)
    with rc_context({"svg.fonttype": "none"}):  # SVG text stays text (searchable)
        fig.savefig(path, dpi=110)
    return path
