"""The `pjit-pipe schedule` command: its JSON contract, its files, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pjit_pipe.cli import main
from pjit_pipe.cli.schedule_command import DEFAULT_ITERATIONS
from pjit_pipe.ir import Costs, from_json
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule
from pjit_pipe.simulator import simulate

REPO = Path(__file__).resolve().parents[1]


def run_json(capsys, *args: str) -> dict:
    assert main(["schedule", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    return json.loads(out)


@pytest.mark.parametrize(
    ("kind", "P", "m", "costs"),
    [("1f1b", 4, 8, "1,1,1"), ("gpipe", 3, 5, "5,6,4,1"), ("1f1b", 2, 1, "2,1,0.5,0.25")],
)
def test_json_figures_equal_the_simulator(capsys, kind: str, P: int, m: int, costs: str) -> None:
    got = run_json(capsys, kind, "--stages", str(P), "--microbatches", str(m), "--costs", costs)
    c = Costs.parse(costs)
    sched = make_schedule(kind, P, m, costs=c)
    want = simulate(sched, c, iterations=DEFAULT_ITERATIONS)
    assert got["valid"] is True
    for key in ("makespan", "span", "ideal", "bubble_ratio", "steady_period"):
        assert got[key] == pytest.approx(getattr(want, key)), key
    assert got["peak_memory"] == [want.peak_memory[w] for w in sched.workers]
    assert len(got["peak_memory"]) == P
    assert from_json(got["schedule"]).programs == sched.programs


def test_stagger_and_iterations_reach_the_steady_period(capsys) -> None:
    c = Costs(1, 1, 1)
    args = ("1f1b", "--stages", "3", "--microbatches", "4", "--iterations", "5")
    plain = run_json(capsys, *args)
    staggered = run_json(capsys, *args, "--stagger")
    want = simulate(stagger(make_schedule("1f1b", 3, 4)), c, iterations=5)
    assert staggered["steady_period"] == pytest.approx(want.steady_period)
    assert staggered["iterations"] == 5
    assert from_json(staggered["schedule"]).staggered
    assert staggered["steady_period"] <= plain["steady_period"]


def test_fused_costs_reach_the_fuse_pass(capsys) -> None:
    """Fused prices 3% under the split's: zb-h1 fuses what the pass fuses and prices it."""
    args = ("zb-h1", "-P", "4", "-m", "8", "--costs", "1.03,1,1")
    c = Costs(1.03, 1, 1, f_fused=1.0, bw=1.97)
    want = make_schedule("zb-h1", 4, 8, costs=c)
    assert want.kind == "zb-h1+fused"
    got = run_json(capsys, *args, "--fused-costs", "1,1.97")
    assert got["kind"] == want.kind
    assert from_json(got["schedule"]).programs == want.programs
    assert got["steady_period"] == pytest.approx(
        simulate(want, c, iterations=DEFAULT_ITERATIONS).steady_period
    )
    assert run_json(capsys, *args)["kind"] == "zb-h1"  # without them: the kind's own


def test_text_mode_prints_the_ir_and_one_summary_line(capsys) -> None:
    assert main(["schedule", "gpipe", "--stages", "2", "--microbatches", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("schedule kind=gpipe stages=2")
    assert [ln.split(" |")[0] for ln in lines[1:3]] == ["0:0", "0:1"]
    assert len(lines) == 4
    makespan = simulate(make_schedule("gpipe", 2, 3)).makespan
    assert f"makespan {makespan:g}" in lines[3]


def test_mem_limit_that_fits_is_accepted(capsys) -> None:
    got = run_json(capsys, "1f1b", "--stages", "4", "--microbatches", "8", "--mem-limit", "4")
    assert max(got["peak_memory"]) <= 4


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_and_trace_files(capsys, tmp_path: Path, suffix: str) -> None:
    plot, trace = tmp_path / f"g{suffix}", tmp_path / "t.json"
    args = ["1f1b", "-P", "2", "-m", "2", "--plot", str(plot), "--trace", str(trace)]
    got = run_json(capsys, *args)
    head = plot.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in plot.read_bytes()
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    ops = sum(len(p["ops"]) for p in got["schedule"]["programs"])
    assert len(events) == ops * got["iterations"]


BAD = {
    "unknown kind": ["schedule", "2f2b", "--stages", "2", "--microbatches", "2"],
    "no kind": ["schedule", "--stages", "2", "--microbatches", "2"],
    "no subcommand": [],
    "unknown subcommand": ["frobnicate"],
    "unknown flag": ["schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--fast"],
    "missing stages": ["schedule", "1f1b", "--microbatches", "2"],
    "zero stages": ["schedule", "1f1b", "--stages", "0", "--microbatches", "2"],
    "negative stages": ["schedule", "1f1b", "--stages", "-2", "--microbatches", "2"],
    "text stages": ["schedule", "1f1b", "--stages", "four", "--microbatches", "2"],
    "missing microbatches": ["schedule", "1f1b", "--stages", "2"],
    "zero microbatches": ["schedule", "1f1b", "--stages", "2", "--microbatches", "0"],
    "negative microbatches": ["schedule", "1f1b", "--stages", "2", "--microbatches", "-1"],
    "two costs": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", "1,2"],
    "five costs": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", "1,2,3,4,5"],
    "empty costs": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", ""],
    "text costs": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", "a,b,c"],
    "negative cost": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", "1,-1,1"],
    "infinite cost": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", "1,inf,1"],
    "negative comm": ["schedule", "1f1b", "-P", "2", "-m", "2", "--costs", "1,1,1,-0.5"],
    "zero chunks": ["schedule", "1f1b", "-P", "2", "-m", "2", "--chunks", "0"],
    "chunks not fitting": ["schedule", "1f1b", "-P", "2", "-m", "2", "--chunks", "3"],
    "mem limit too small": ["schedule", "1f1b", "-P", "4", "-m", "8", "--mem-limit", "2"],
    "zero mem limit": ["schedule", "1f1b", "-P", "2", "-m", "2", "--mem-limit", "0"],
    "text mem limit": ["schedule", "1f1b", "-P", "2", "-m", "2", "--mem-limit", "lots"],
    "plot suffix": ["schedule", "1f1b", "-P", "2", "-m", "2", "--plot", "g.pdf"],
    "trace suffix": ["schedule", "1f1b", "-P", "2", "-m", "2", "--trace", "t.txt"],
    "zero iterations": ["schedule", "1f1b", "-P", "2", "-m", "2", "--iterations", "0"],
    "one fused cost": ["schedule", "zb-h1", "-P", "2", "-m", "2", "--fused-costs", "1"],
    "negative fused cost": ["schedule", "zb-h1", "-P", "2", "-m", "2", "--fused-costs", "1,-2"],
    "m < P": ["schedule", "interleaved-1f1b", "-P", "4", "-m", "2", "--chunks", "2"],
    "plot dir missing": ["schedule", "1f1b", "-P", "2", "-m", "2", "--plot", "/nonexistent/g.png"],
}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_every_bad_argument_fails_with_one_line(capsys, argv: list[str]) -> None:
    assert main(argv) != 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1 and err.startswith("error:")


def test_error_names_the_problem(capsys) -> None:
    main(["schedule", "1f1b", "-P", "4", "-m", "8", "--mem-limit", "2"])
    assert "memory" in capsys.readouterr().err
    main(["schedule", "1f1b", "-P", "2", "-m", "2", "--plot", "g.pdf"])
    assert ".png or .svg" in capsys.readouterr().err


def test_module_entry_point() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pjit_pipe",
            "schedule",
            "1f1b",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert (
        got["valid"] is True and got["makespan"] == simulate(make_schedule("1f1b", 2, 2)).makespan
    )


def test_exact_flag_is_for_auto_only(capsys):
    assert main(["schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--exact", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert "--exact" in err and "\n" not in err
