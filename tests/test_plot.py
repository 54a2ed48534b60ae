"""Gantt charts and Chrome traces: the files exist, parse, and show the simulated events."""

from __future__ import annotations

import json
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from pjit_pipe.ir import Costs, Kind
from pjit_pipe.ir.ops import format_op
from pjit_pipe.passes import defer_w, insert_comm, split_backward
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator import simulate
from pjit_pipe.simulator.charts import gantt
from pjit_pipe.simulator.chrome_trace import chrome_trace

COSTS = Costs(1, 1, 1, 0.25, opt=0.5)


def every_kind_schedule():
    """Split 1F1B with deferred W and explicit comm: F, B, W, OPT, SEND, RECV all appear."""
    return insert_comm(defer_w(split_backward(make_schedule("1f1b", 3, 4)), COSTS))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_png_is_written(tmp_path: Path) -> None:
    out = gantt(every_kind_schedule(), tmp_path / "g.png", COSTS)
    width, height = png_size(out)
    assert width > height > 0


def test_svg_shows_title_figures_and_microbatch_numbers(tmp_path: Path) -> None:
    sched = every_kind_schedule()
    result = simulate(sched, COSTS)
    out = gantt(sched, tmp_path / "g.svg", COSTS)
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    texts = [t.text or "" for t in root.iter() if t.tag.endswith("text")]
    title = next(t for t in texts if "makespan" in t)
    assert sched.kind in title
    assert f"makespan {result.makespan:g}" in title
    assert f"bubble {result.bubble_ratio:.1%}" in title
    assert {str(j) for j in range(sched.microbatches)} <= set(texts)
    kinds = {op.kind.value for _, _, op in sched.ops()}
    assert kinds == {k.value for k in Kind} - {"BW"}
    assert kinds <= set(texts)  # the legend names every kind drawn


def test_a_sim_result_with_several_iterations_and_a_title(tmp_path: Path) -> None:
    result = simulate(make_schedule("gpipe", 2, 2), iterations=3)
    out = gantt(result, tmp_path / "r.svg", title="my gpipe")
    texts = [t.text or "" for t in ET.parse(out).getroot().iter() if t.tag.endswith("text")]
    assert any(t.startswith("my gpipe") and "makespan" in t for t in texts)


def test_every_op_is_one_box_at_its_simulated_time_on_its_worker_row() -> None:
    from matplotlib.figure import Figure

    from pjit_pipe.simulator import draw_gantt

    sched = make_schedule("zb-h1", 4, 8, replicas=2, failed={(1, 2)})
    result = simulate(sched, COSTS)
    ax = Figure().add_subplot()
    draw_gantt(ax, result, "t", width=12.0)
    row = {w: i for i, w in enumerate(sorted(result.busy))}
    drawn = []  # (left, width, row) of every box, read back from the axes' collections
    for collection in ax.collections:
        for path in collection.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(0), path.vertices.max(0)
            if x1 > x0:
                drawn.append((round(x0, 9), round(x1 - x0, 9), round((y0 + y1) / 2)))
    expected = [
        (round(e.start, 9), round(e.end - e.start, 9), row[e.worker])
        for e in result.events
        if e.end > e.start
    ]
    assert sorted(drawn) == sorted(expected)


@pytest.mark.parametrize("name", ["g.pdf", "g", "g.png.txt"])
def test_other_suffixes_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        gantt(make_schedule("1f1b", 2, 2), tmp_path / name)
    assert not (tmp_path / name).exists()


def test_chrome_trace_has_one_event_per_op_with_simulated_times() -> None:
    sched = every_kind_schedule()
    result = simulate(sched, COSTS, iterations=2)
    trace = json.loads(json.dumps(chrome_trace(result)))  # JSON-serialisable
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 2 * sum(len(sched.program(w)) for w in sched.workers)
    by_key = {(e["pid"], e["tid"], e["args"]["iteration"], e["args"]["index"]): e for e in complete}
    for ev in result.events:
        got = by_key[(ev.worker.replica, ev.worker.stage, ev.iteration, ev.index)]
        assert got["name"] == format_op(sched.program(ev.worker)[ev.index], ev.worker.replica)
        assert got["ts"] == pytest.approx(ev.start)
        assert got["dur"] == pytest.approx(ev.end - ev.start)
    tracks = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == {(w.replica, w.stage) for w in sched.workers}


def test_the_tick_chart_names_its_ticks_and_marks_the_fused_op(tmp_path: Path) -> None:
    """The compiled program's table priced in lockstep: its tick count and lane order
    in the heading, its lockstep makespan, and a legend entry for the fused op
    (one stage: every microbatch's F and BW run as one op)."""
    from pjit_pipe.simulator.charts import tick_gantt
    from pjit_pipe.tick_packing.packer import pack_ticks

    sched = make_schedule("1f1b", 1, 3)
    costs = Costs(1, 2, 1, fbw=3)
    table = pack_ticks(sched, costs)
    out = tick_gantt(table, tmp_path / "t.svg", costs)
    texts = [t.text or "" for t in ET.parse(out).getroot().iter() if t.tag.endswith("text")]
    title = next(t for t in texts if "makespan" in t)
    assert f"{len(table)} ticks (F, B, W)" in title
    lockstep = simulate(sched, costs, mode="lockstep", ticks=table)
    assert f"makespan {lockstep.makespan:g}" in title and lockstep.makespan == pytest.approx(9)
    assert "one op" in texts
    plain = tick_gantt(pack_ticks(make_schedule("zb-h1", 2, 2), COSTS), tmp_path / "z.png", COSTS)
    assert png_size(plain)[0] > 0


def test_cli_draws_the_tick_table(tmp_path: Path) -> None:
    from pjit_pipe.cli import main

    out = tmp_path / "ticks.png"
    args = ["schedule", "zb-h1", "-P", "2", "-m", "3", "--plot-ticks", str(out)]
    assert main(args) == 0
    assert png_size(out)[0] > 0
