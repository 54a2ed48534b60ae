"""Composable passes: `chain` applies passes left to right; `postpone_w` makes ZB-H1 from 1F1B."""

from __future__ import annotations

import functools

import pytest

from pjit_pipe.ir import B, Costs, Kind, W
from pjit_pipe.ir.memory import peak_memory
from pjit_pipe.ir.validate import validate
from pjit_pipe.passes import chain, defer_w, postpone_w, renamed, split_backward, stagger
from pjit_pipe.schedules import make_schedule
from pjit_pipe.schedules.classic import one_f_one_b
from pjit_pipe.simulator import simulate


def test_chain_applies_passes_left_to_right() -> None:
    base = one_f_one_b(3, 6, 2)
    costs = Costs(1.0, 1.0, 1.0)
    by_hand = stagger(defer_w(split_backward(base), costs))
    chained = chain(split_backward, functools.partial(defer_w, costs=costs), stagger)(base)
    assert chained == by_hand
    assert chained.kind == "1f1b+split+defer_w+stagger"
    nested = chain(chain(split_backward), chain(functools.partial(defer_w, costs=costs), stagger))
    assert nested(base) == by_hand


def test_empty_chain_is_the_identity_and_a_bad_pass_is_named() -> None:
    base = one_f_one_b(2, 4)
    assert chain()(base) is base
    with pytest.raises(TypeError, match="pass #1"):
        chain(split_backward, "stagger")


@pytest.mark.parametrize("P,m", [(2, 2), (3, 7), (4, 8), (4, 3)])
def test_postpone_w_turns_1f1b_into_zb_h1(P: int, m: int) -> None:
    """The W of microbatch k runs right after the B of k + p on position p; ZB-H1's closed
    form makespan m(F+B+W) + (P-1)(F+B-W) at C=0 (m >= P) and its peak memory <= P hold."""
    costs = Costs(1.0, 1.0, 0.5)
    built = chain(split_backward, postpone_w(lambda p: p), renamed("zb-h1"))(one_f_one_b(P, m))
    validate(built, mem_limit=P)
    assert built == make_schedule("zb-h1", P, m)
    for w, prog in built.programs.items():
        bs = [op.mb for op in prog if op.kind is Kind.B]
        for k, j in enumerate(bs[: m - w.stage]):
            b_at = prog.index(B(w.stage, bs[k + w.stage], w.replica))
            assert prog[b_at + 1] == W(w.stage, j, w.replica), (w, k)
    if m >= P:
        expected = m * (1.0 + 1.0 + 0.5) + (P - 1) * (1.0 + 1.0 - 0.5)
        assert simulate(built, costs).makespan == pytest.approx(expected)
    assert max(peak_memory(built).values()) <= P


def test_postpone_w_by_zero_is_a_plain_split() -> None:
    base = split_backward(one_f_one_b(3, 5, 2))
    assert postpone_w(lambda p: 0)(base).programs == base.programs
