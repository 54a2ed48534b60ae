"""Asynchronous 1F1B in the IR, the simulator and the CLI (no JAX compile)."""

from __future__ import annotations

import itertools
import json

import pytest

from pjit_pipe.cli import main
from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.lockstep import iteration_ticks
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.ops import OPT, Kind, Worker
from pjit_pipe.ir.schedule import ScheduleError
from pjit_pipe.ir.serialize import from_json, from_text, to_json, to_text
from pjit_pipe.ir.ticks import PackedTicks
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import stagger
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.simulator.simulate import simulate
from pjit_pipe.tick_packing.packer import pack_ticks


@pytest.mark.parametrize("stages", [4, 8])
@pytest.mark.parametrize("costs", [Costs(1, 1, 1, 0), Costs(1, 2, 1, 0)])
def test_steady_period_is_ideal(stages, costs):
    m = 2 * stages
    s = validate(make_schedule("async-1f1b", stages, m, costs=costs))
    result = simulate(s, costs, iterations=12)
    ideal = m * (costs.f + costs.b + costs.w)
    assert result.ideal == ideal
    assert abs(result.steady_period - ideal) <= 0.02 * ideal
    # the synchronous 1F1B flushes every iteration, even with its optimizer staggered
    sync = simulate(make_schedule("1f1b", stages, m), costs, iterations=12)
    assert sync.steady_period > 1.1 * ideal


def test_steady_state_runs_f_bw_opt_back_to_back():
    P, m = 4, 8
    s = make_schedule("async-1f1b", P, m)
    events = simulate(s, Costs(1, 1, 1, 0), iterations=4).events
    first = [e for e in events if e.worker == Worker(0, 0)]
    first.sort(key=lambda e: e.start)
    # from its first backward of iteration 1 to its last of iteration 2 (fill and drain
    # excluded), worker 0:0 never idles: each op starts when the previous one ended
    bws = [e for e in first if e.op.kind is Kind.BW]
    t0 = min(e.start for e in bws if e.iteration == 1)
    t1 = max(e.end for e in bws if e.iteration == 2)
    busy = [e for e in first if t0 <= e.start < t1 and e.op.kind is not Kind.OPT]
    assert len(busy) >= 2 * m
    assert all(b.start == a.end for a, b in itertools.pairwise(busy))
    # and the next iteration's forwards start before this iteration's last backward
    last_bw = max(e.end for e in first if e.iteration == 0 and e.op.kind is Kind.BW)
    next_f = min(e.start for e in first if e.iteration == 1 and e.op.kind is Kind.F)
    assert next_f < last_bw


def test_one_opt_per_microbatch_after_its_backward():
    P, m = 3, 5
    s = make_schedule("async-1f1b", P, m, replicas=2)
    assert s.asynchronous and s.staggered
    for w in s.workers:
        prog = s.program(w)
        opts = [op for op in prog if op.kind is Kind.OPT]
        assert [op.mb for op in opts] == list(range(m))
        for op in opts:
            assert prog.index(op) == prog.index(op._replace(kind=Kind.BW, replica=w.replica)) + 1
    assert peak_memory(s) == peak_memory(make_schedule("1f1b", P, m, replicas=2))


def test_text_and_json_round_trip():
    s = make_schedule("async-1f1b", 3, 4)
    assert "OPT0.3" in to_text(s)
    assert from_text(to_text(s)) == s
    assert from_json(json.loads(json.dumps(to_json(s)))) == s


def test_validator_rejects_missing_or_misplaced_async_opt():
    s = make_schedule("async-1f1b", 2, 2)
    w = Worker(0, 0)
    prog = list(s.program(w))
    dropped = s.replace(programs={**s.programs, w: [op for op in prog if op != OPT(0, 0, 1)]})
    with pytest.raises(ScheduleError, match=r"OPT0\.1 never runs"):
        validate(dropped)
    early = [OPT(0, 0, 1)] + [op for op in prog if op != OPT(0, 0, 1)]
    with pytest.raises(ScheduleError, match="runs before"):
        validate(s.replace(programs={**s.programs, w: early}))
    mixed = [*prog, OPT(0, 0)]
    with pytest.raises(ScheduleError, match="steps per microbatch"):
        validate(s.replace(programs={**s.programs, w: mixed}))


def test_fewer_microbatches_than_stages_is_rejected():
    with pytest.raises(ScheduleError, match="microbatches >= 4"):
        make_schedule("async-1f1b", 4, 3)


def test_cli_prints_schedule(capsys):
    argv = ["schedule", "async-1f1b", "-P", "4", "-m", "8", "--iterations", "12"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] and data["kind"] == "async-1f1b"
    assert abs(data["steady_period"] - 24) <= 0.02 * 24
    assert main(["schedule", "async-1f1b", "-P", "4", "-m", "2"]) == 1
    assert "microbatches >= 4" in capsys.readouterr().err


def test_stagger_keeps_and_failures_reject_async():
    s = make_schedule("async-1f1b", 3, 3)
    assert stagger(s) == s
    with pytest.raises(ScheduleError, match="not supported yet"):
        schedule_with_failures("async-1f1b", 2, 2, 2, [(0, 1)])


def test_cli_train_rejects_bad_async_requests(capsys):
    assert main(["train", "--schedule", "1f1b", "--async-weights", "stash", "--steps", "1"]) == 2
    assert "--async-weights stash applies to --schedule async-1f1b only" in capsys.readouterr().err
    argv = ["train", "--schedule", "async-1f1b", "--mesh", "1x4", "--microbatches", "2"]
    assert main([*argv, "--steps", "1"]) == 1
    assert "async-1f1b needs microbatches >= 4" in capsys.readouterr().err


def test_lockstep_runs_the_overlapping_stream_without_opt_ticks():
    P, m = 4, 8
    s = make_schedule("async-1f1b", P, m)
    ticks = [iteration_ticks(s, n) for n in (5, 6)]
    # steady state: every tick one F or one BW per worker, OPTs between ticks
    assert len(ticks[1]) - len(ticks[0]) == 2 * m
    assert all(op.kind is not Kind.OPT for t in ticks[1] for _, op in t.values())
    # worker 0:0 starts iteration 1 before it finishes iteration 0 (no flush)
    mine = [t[Worker(0, 0)] for t in ticks[1] if Worker(0, 0) in t]
    first_next = mine.index(next(x for x in mine if x[0] == 1))
    assert any(it == 0 for it, _ in mine[first_next:])


def test_tick_table_steps_each_microbatch_after_its_last_backward():
    """The table the lowering compiles: one OPT per stage, microbatch and replica, at the end
    of the tick of that microbatch's last W/BW of the stage (every replica's in one tick),
    with each worker's ops in their stream order; pack_ticks keeps it unpacked."""
    P, m, D, iters = 3, 4, 2, 3
    s = make_schedule("async-1f1b", P, m, replicas=D)
    table = pack_ticks(s, Costs(1, 2, 1, 0), iters)
    assert table == PackedTicks.one_op_per_tick(s, iters)
    table.check()
    last_grad, opt_tick = {}, {}
    for t, tick in enumerate(table.ticks):
        for w, entries in tick.items():
            for it, op in entries:
                if op.kind is Kind.BW:
                    last_grad[(op.stage, op.mb, it)] = t
                elif op.kind is Kind.OPT:
                    opt_tick.setdefault((op.stage, op.mb, it), set()).add((t, w.replica))
    assert len(opt_tick) == P * m * iters
    for key, placed in opt_tick.items():
        assert {t for t, _ in placed} == {last_grad[key]}
        assert {r for _, r in placed} == set(range(D))
    # moving stage 0's first OPT (both replicas') after their next forward breaks the order
    ticks = [dict(t) for t in table.ticks]
    for w in (Worker(0, 0), Worker(1, 0)):
        i = next(i for i, t in enumerate(ticks) if any(o.kind is Kind.OPT for _, o in t.get(w, ())))
        j = next(j for j in range(i + 1, len(ticks)) if w in ticks[j])
        assert ticks[j][w][0][1].kind is Kind.F
        opt = ticks[i][w][-1]
        ticks[i][w] = ticks[i][w][:-1]
        ticks[j][w] = (*ticks[j][w], opt)
    with pytest.raises(ScheduleError, match="stream order"):
        PackedTicks(s, iters, tuple(ticks)).check()
