"""The compiled tick loop updates its carried stores in place (optimized HLO, CPU).

The loop carries the message store, the residual stores and the gradient
accumulators (tick.py). A `copy` of one of them inside the loop body is a
whole-store memory pass per tick; the body must hold none, and run one
conditional per lane group (F, B, W of each chunk) with no loop inside it.
Two compiles of zb-h1 on 1x4, so the F, B and W lanes all run (B writes a
split stage's cotangents into the residual store): one op per tick, and a
table packed in the lane order B, W, F (an F writes the residual slot its
tick's W read last), tables with two W's a tick, and 1F1B with its last
stage's F and BW fused into one op, deferred tables (ir/ticks.py) of
either lane order, whose late channel waits in an outbox row of the message
store, and a re-routed deferred table on 2x4, whose ticks gate their
ppermutes with a switch at each delivery. The loss and gradients of each
program are checked against jax.value_and_grad.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import pytest
from test_lowering import (
    assert_trees_close,
    batch,
    mesh_of,
    reference_value_and_grad,
    tiny_model,
    xent,
)

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.ops import Kind
from pjit_pipe.ir.ticks import FORWARD_FIRST, FORWARD_LAST, PackedTicks, lane_order
from pjit_pipe.lowering import lower
from pjit_pipe.lowering.compute.tick import SWITCH_UPDATES_IN_PLACE
from pjit_pipe.lowering.tick_plan import build_plan
from pjit_pipe.schedules import make_schedule, schedule_with_failures
from pjit_pipe.tick_packing.packer import pack_ticks

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_CALLEES = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"= \((.*?)\) while\(.*body=%([\w.\-]+)")
_SHAPE = re.compile(r"\b([a-z]+\d*\[[\d,]*\])")


def computations(hlo: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from `compile().as_text()`."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        found = None if line.startswith(" ") else _COMPUTATION.match(line)
        if found:
            name = found.group(1)
            out[name] = []
        elif name is not None and line.startswith("  "):
            out[name].append(line)
    return out


def reachable(comps: dict[str, list[str]], root: str) -> set[str]:
    """`root` and every computation it calls (fusions, branches, loops), transitively."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            todo += _CALLEES.findall(line)
            for group in _BRANCHES.findall(line):
                todo += [b.strip().lstrip("%") for b in group.split(",")]
    return seen


def tick_loop(hlo: str, store_shape: str) -> tuple[str, set[str]]:
    """(body computation, shapes of its non-scalar carried buffers) of the while loop
    that carries a buffer of `store_shape` (e.g. 'f32[3,18]', the message store)."""
    loops = [
        (body, {s for s in _SHAPE.findall(carry) if not s.endswith("[]")})
        for carry, body in _WHILE.findall(hlo)
    ]
    (loop,) = [(body, shapes) for body, shapes in loops if store_shape in shapes]
    return loop


def body_report(hlo: str, store_shape: str) -> tuple[list[str], int, int]:
    """(copies of carried-buffer shapes anywhere in the loop body, conditionals at the
    body's top level, while loops nested in the body)."""
    comps = computations(hlo)
    body, carried = tick_loop(hlo, store_shape)
    copies = [
        line.strip()
        for name in reachable(comps, body)
        for line in comps[name]
        if " copy(" in line and _SHAPE.search(line.split("=", 1)[1]).group(1) in carried
    ]
    conds = sum(" conditional(" in line for line in comps[body])
    loops = sum(" while(" in line for name in reachable(comps, body) for line in comps[name])
    return copies, conds, loops


@pytest.fixture(scope="module")
def zb_h1():
    P, m = 4, 4
    sched = make_schedule("zb-h1", P, m)
    fns, params = tiny_model(P)
    x, y = batch(m * 2, seed=1)
    step = lower(sched, fns, xent, mesh_of(1, P), params, x, y)
    return step, fns, params, x, y


def packed_program(kind: str, P: int, m: int, costs: Costs, order, deferred: bool = False):
    """(step, fns, params, x, y): `kind` on a 1 x P mesh, compiled from its table packed
    under `costs` in the lane `order` (sending its late channel at the start of the
    next tick if `deferred`), on the tiny model."""
    sched = make_schedule(kind, P, m, costs=costs)
    table = dataclasses.replace(pack_ticks(sched, costs, orders=(order,)), deferred=deferred)
    fns, params = tiny_model(P)
    x, y = batch(m * 2, seed=1)
    step = lower(table, fns, xent, mesh_of(1, P), params, x, y)
    return step, fns, params, x, y


@pytest.fixture(scope="module")
def zb_h1_forward_last():
    # (at m=4 no tick holds both a W and an F)
    return packed_program("zb-h1", 4, 6, Costs(1, 2, 1), FORWARD_LAST)


@pytest.fixture(scope="module")
def zb_h2_two_ws():
    """A table whose ticks hold two W's of a worker (ir.ticks.W_PER_TICK), F first."""
    return packed_program("zb-h2", 4, 8, Costs(1, 2, 1), FORWARD_FIRST)


@pytest.fixture(scope="module")
def zb_h1_two_ws_forward_last():
    """Ticks "W, W, F": the F writes a W-pool slot one of the two W's read last."""
    return packed_program("zb-h1", 2, 4, Costs(1, 4, 1), FORWARD_LAST)


@pytest.fixture(scope="module")
def one_f_one_b_fused():
    """The last stage's F and BW of each microbatch run as one op in the W lane
    (plan.FUSED), which reads its input from the message store and adds a loss."""
    return packed_program("1f1b", 4, 4, Costs(1, 2, 1, fbw=3), FORWARD_FIRST)


@pytest.fixture(scope="module")
def zb_h1_deferred():
    """Gradients sent at the start of the next tick: the B lane reads what the tick's
    first delivery wrote, and each tick writes its gradient to the outbox row."""
    return packed_program("zb-h1", 4, 6, Costs(1, 2, 1, 1), FORWARD_FIRST, deferred=True)


@pytest.fixture(scope="module")
def zb_h1_forward_last_deferred():
    """Activations sent at the start of the next tick (the late channel of B, W, F)."""
    return packed_program("zb-h1", 4, 6, Costs(1, 2, 1, 1), FORWARD_LAST, deferred=True)


@pytest.fixture(scope="module")
def zb_h1_rerouted_deferred():
    """Re-routed (2x4, worker (1, 2) failed) and deferred: its ticks gate their
    ppermutes, one switch at the start of a tick (the late channel) and one at
    its end."""
    sched = schedule_with_failures("zb-h1", 4, 4, 2, [(1, 2)], time_limit=1.0)
    table = pack_ticks(sched, Costs(5, 6, 4, 1))
    fns, params = tiny_model(4)
    x, y = batch(2 * 4 * 2, seed=1)
    step = lower(table, fns, xent, mesh_of(2, 4), params, x, y)
    return step, fns, params, x, y


# The lane conds of each program's tick: F, B and W lanes, and the second W where a
# tick has one (a plan that gates its ppermutes adds a switch per delivery).
CONDS = {
    "zb_h1": 3,
    "zb_h1_forward_last": 3,
    "zb_h1_deferred": 3,
    "zb_h1_forward_last_deferred": 3,
    "zb_h2_two_ws": 4,
    "zb_h1_two_ws_forward_last": 4,
    "one_f_one_b_fused": 2,  # 1F1B has no B lane
    "zb_h1_rerouted_deferred": 3,
}


@pytest.mark.parametrize("program", list(CONDS))
def test_tick_loop_copies_no_carried_store(program, request):
    step, fns, params, x, y = request.getfixturevalue(program)
    low = step._low
    two_ws = [
        [op.kind for _, op in es]
        for tick in low.ticks.ticks
        for es in tick.values()
        if sum(op.kind is Kind.W for _, op in es) == 2
    ]
    assert bool(two_ws) == (CONDS[program] == 4)
    if program == "zb_h1_two_ws_forward_last":
        assert any(kinds[-3:] == [Kind.W, Kind.W, Kind.F] for kinds in two_ws)
    assert low.fused == (program == "one_f_one_b_fused")
    assert low.plan.deferred == program.endswith("_deferred")
    gated = len(low.plan.sends) > 1
    assert gated == (program == "zb_h1_rerouted_deferred")
    compiled = step._vg.lower(list(params), x, y).compile()
    ((dtype, size),) = low.msg_spec.sizes.items()
    store = f"{jnp.dtype(dtype).kind}{jnp.dtype(dtype).itemsize * 8}"
    message_store = f"{store}[{low.plan.store_rows},{size}]"
    copies, conds, loops = body_report(compiled.as_text(), message_store)
    assert copies == []
    groups = [low.ops.forwards, low.ops.input_grads, *low.ops.weight_grads]
    if two_ws:
        groups += low.ops.second_weight_grads
    assert sum(1 for ids, _ in groups if ids) == CONDS[program]
    # Where XLA would copy the residual stores out of a switch, F and B (which write
    # into them) run one cond per stage.
    writers = (low.ops.forwards, low.ops.input_grads)
    chained = 0 if SWITCH_UPDATES_IN_PLACE else sum(len(fns) - 1 for ids, fns in writers if ids)
    assert conds == CONDS[program] + chained + (1 + low.plan.deferred) * gated
    assert loops == 0
    # The program inspected computes what jax.value_and_grad does.
    loss, grads = compiled(list(params), x, y)
    ref_loss, ref_grads = reference_value_and_grad(fns, params, x, y)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert_trees_close(grads, ref_grads)


def _w_pool_peak(table: PackedTicks) -> int:
    """The most W-pool rows (F to the stage's last W or BW) a worker holds, counted
    op by op in the order its ticks run them."""
    peak = 0
    for w in table.schedule.alive_workers:
        held = 0
        for tick in table.ticks:
            for _, op in tick.get(w, ()):
                held += {Kind.F: 1, Kind.W: -1, Kind.BW: -1}.get(op.kind, 0)
                peak = max(peak, held)
    return peak


def test_forward_last_reuses_a_slot_its_tick_read(zb_h1_forward_last):
    """Under B, W, F an F may write the W-pool slot that a W of its tick read last,
    so the store is sized by the rows in flight counted in run order; the same
    ticks run F first need one slot more."""
    step = zb_h1_forward_last[0]
    low = step._low
    table = low.ticks
    assert table.order == FORWARD_LAST
    assert any(
        [op.kind for _, op in es][-2:] == [Kind.W, Kind.F]
        for tick in table.ticks
        for es in tick.values()
    )
    assert low.plan.res_slots == _w_pool_peak(table)
    forward_first = PackedTicks(
        table.schedule,
        1,
        tuple(
            {
                w: (
                    *lane_order([e for e in es if e[1].kind is not Kind.OPT]),
                    *(e for e in es if e[1].kind is Kind.OPT),
                )
                for w, es in tick.items()
            }
            for tick in table.ticks
        ),
        FORWARD_FIRST,
    )
    forward_first.check()
    plan = build_plan(forward_first, False, low.topo.workers, split=low.st.split)
    assert plan.res_slots == _w_pool_peak(forward_first) == low.plan.res_slots + 1
