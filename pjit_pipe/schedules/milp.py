"""The MILP of the exact engine (`pjit_pipe.schedules.exact`): ops, windows, rows, binaries.

`Problem` holds one (P, m, costs) instance: op indices, durations, the fixed
precedences (the execution engine's dependency rule, `pjit_pipe.ir.engine.needs`,
plus the FIFO chains and the memory-forced B's) and the time windows their
longest paths give. `build` writes the model for HiGHS: one start column per
op, the makespan column, and a binary per pair of ops of one worker whose
order the windows leave open.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import highspy
import numpy as np

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import makes, needs
from pjit_pipe.ir.memory import limit_units
from pjit_pipe.ir.ops import Kind

KINDS = (Kind.F, Kind.B, Kind.W)
PAIRS = ((0, 1), (0, 2), (1, 2))  # (earlier kind, later kind) of the ordering binaries
GAP = 1e-6

Program = list[tuple[int, int]]  # one worker's ops as (kind index 0/1/2 = F/B/W, microbatch)

_MADE_BY = {makes(kind): k for k, kind in enumerate(KINDS) if makes(kind)}  # payload -> k


class Problem:
    """Ops, durations, precedences and time windows of one (P, m, costs) instance."""

    def __init__(self, stages: int, microbatches: int, costs: Costs, limit: float | None):
        self.P, self.m = stages, microbatches
        table = costs.per_stage(stages)
        self.dur = [[row[k] for row in table] for k in range(3)]  # dur[kind][stage]
        self.costs = costs
        self.c, self.opt = costs.c, costs.opt
        self.n = 3 * stages * microbatches
        self.edges = list(self._edges(limit))
        self.est, self.tail = self._windows()

    def idx(self, k: int, s: int, j: int) -> int:
        return (s * 3 + k) * self.m + j

    def d(self, k: int, s: int) -> float:
        return self.dur[k][s]

    def _edges(self, limit: float | None) -> Iterator[tuple[int, int, float]]:
        """Fixed precedences (a, b, lag): start(b) >= start(a) + lag.

        Besides the dataflow and the FIFO chains, a memory limit L forces B's
        before F's: after F_i at most L microbatches are in flight and W_j never
        precedes B_j, so at least i+1-L B's ran before F_i.
        """
        P, m, c = self.P, self.m, self.c
        for s in range(P):
            f, b, w = (self.d(k, s) for k in range(3))
            # The engine's dependencies, inputs from other stages first (the model's row order).
            deps = [
                (k, sorted(needs(kind, s, P - 1), key=lambda need: need[1] == s))
                for k, kind in enumerate(KINDS)
            ]
            for j in range(m):
                for k, inputs in deps:
                    for payload, src in inputs:
                        made = _MADE_BY[payload]
                        lag = self.d(made, src) + (c if src != s else 0.0)
                        yield self.idx(made, src, j), self.idx(k, s, j), lag
                if j > 0:
                    yield self.idx(0, s, j - 1), self.idx(0, s, j), f
                    yield self.idx(1, s, j - 1), self.idx(1, s, j), b
                    yield self.idx(2, s, j - 1), self.idx(2, s, j), w
                if limit is not None and (needed := math.ceil(j + 1 - limit - 1e-9)) > 0:
                    yield self.idx(1, s, needed - 1), self.idx(0, s, j), b

    def load_before(self, k: int, s: int, j: int) -> float:
        """Work the FIFO chains force onto worker s before op (k, s, j) starts."""
        f, b, w = (self.d(x, s) for x in range(3))
        return (j * f, (j + 1) * f + j * b, (j + 1) * (f + b) + j * w)[k]

    def load_from(self, k: int, s: int, j: int) -> float:
        """Work the FIFO chains force onto worker s from the start of op (k, s, j) on."""
        f, b, w = (self.d(x, s) for x in range(3))
        rest = self.m - j
        return (rest * (f + b + w), rest * (b + w), rest * w)[k] + self.opt

    def _ops(self) -> Iterator[tuple[int, int, int]]:
        """(kind, stage, mb) in index order."""
        for s in range(self.P):
            for k in range(3):
                for j in range(self.m):
                    yield k, s, j

    def _windows(self) -> tuple[np.ndarray, np.ndarray]:
        """Longest paths: earliest start of every op, and least time from its start to the end.

        Both also count the work the chains force onto the op's worker before
        (after) it, which every other op of that worker waits behind F(s, 0).
        """
        preds: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        succs: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        for a, b, lag in self.edges:
            preds[b].append((a, lag))
            succs[a].append((b, lag))
        order, waiting = [], [len(p) for p in preds]
        ready = [a for a in range(self.n) if not waiting[a]]
        while ready:
            a = ready.pop()
            order.append(a)
            for b, _ in succs[a]:
                waiting[b] -= 1
                if not waiting[b]:
                    ready.append(b)
        ops = list(self._ops())
        est, tail = np.zeros(self.n), np.zeros(self.n)
        for a in order:
            k, s, j = ops[a]
            est[a] = max(
                [est[p] + lag for p, lag in preds[a]]
                + [est[self.idx(0, s, 0)] + self.load_before(k, s, j)]
            )
        for a in reversed(order):
            tail[a] = max([lag + tail[b] for b, lag in succs[a]] + [self.load_from(*ops[a])])
        return est, tail

    def windows(self, upper: float) -> tuple[np.ndarray, np.ndarray]:
        """(earliest, latest) start of every op in any schedule of makespan <= upper."""
        return self.est, upper - self.tail

    def lower_bound(self) -> float:
        """Makespan bound before any order is chosen: the longest path through the windows."""
        return float(np.max(self.est + self.tail))


class Model:
    """Columns and rows of a MILP, passed to HiGHS in one go."""

    def __init__(self) -> None:
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[int] = []
        self.rows: list[tuple[float, float, dict[int, float]]] = []

    def col(self, lo: float, hi: float, integer: bool = False) -> int:
        self.lo.append(lo)
        self.hi.append(hi)
        if integer:
            self.integer.append(len(self.lo) - 1)
        return len(self.lo) - 1

    def row(self, lo: float, hi: float, coefs: dict[int, float]) -> None:
        self.rows.append((lo, hi, coefs))

    def solver(self, objective_col: int) -> highspy.Highs:
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        n = len(self.lo)
        cost = np.zeros(n)
        cost[objective_col] = 1.0
        h.addCols(n, cost, np.array(self.lo), np.array(self.hi), 0, [], [], [])
        starts, index, value = [], [], []
        for _, _, coefs in self.rows:
            starts.append(len(index))
            index.extend(coefs)
            value.extend(coefs.values())
        h.addRows(
            len(self.rows),
            np.array([r[0] for r in self.rows]),
            np.array([r[1] for r in self.rows]),
            len(index),
            np.array(starts, dtype=np.int32),
            np.array(index, dtype=np.int32),
            np.array(value, dtype=np.float64),
        )
        ints = np.array(self.integer, dtype=np.int32)
        h.changeColsIntegrality(
            len(ints), ints, np.full(len(ints), highspy.HighsVarType.kInteger, dtype=np.uint8)
        )
        return h


def build(
    prob: Problem, limit: float | None, upper: float, lower: float
) -> tuple[Model, int, dict]:
    """The MILP: start columns 0..n-1, the makespan column, and the ordering binaries."""
    P, m = prob.P, prob.m
    est, lst = prob.windows(upper)
    tol = 1e-9 * max(upper, 1.0)
    model = Model()
    for a in range(prob.n):
        model.col(est[a], max(lst[a], est[a]))
    T = model.col(lower, upper)
    x: dict[tuple[int, int, int, int, int], int] = {}  # (s, ka, kb, i, j) -> "ka_i before kb_j"
    for a, b, lag in prob.edges:
        model.row(lag, math.inf, {b: 1.0, a: -1.0})
    for s in range(P):
        for ka, kb in PAIRS:
            da, db = prob.d(ka, s), prob.d(kb, s)
            for i in range(m):
                for j in range(i):
                    a, b = prob.idx(ka, s, i), prob.idx(kb, s, j)
                    can_ab = est[a] + da <= lst[b] + tol
                    can_ba = est[b] + db <= lst[a] + tol
                    v = x[s, ka, kb, i, j] = model.col(0 if can_ba else 1, 1 if can_ab else 0, True)
                    if can_ab:  # x = 1: a ends before b starts
                        big = max(lst[a] + da - est[b], 0.0)
                        model.row(-math.inf, big - da, {a: 1.0, b: -1.0, v: big})
                    if can_ba:  # x = 0: b ends before a starts
                        big = max(lst[b] + db - est[a], 0.0)
                        model.row(-math.inf, -db, {b: 1.0, a: -1.0, v: -big})

    def rel(s: int, ka: int, i: int, kb: int, j: int) -> tuple[float, dict[int, float]]:
        """'ka_i before kb_j' on stage s (ka < kb) as constant + linear terms."""
        return (1.0, {}) if i <= j else (0.0, {x[s, ka, kb, i, j]: 1.0})

    def add(*terms: tuple[float, tuple[float, dict[int, float]]], lo=-math.inf, hi=math.inf):
        const, coefs = 0.0, {}
        for scale, (c0, lin) in terms:
            const += scale * c0
            for col, val in lin.items():
                coefs[col] = coefs.get(col, 0.0) + scale * val
        if coefs:
            model.row(lo - const, hi - const, coefs)

    for s in range(P):
        # Transitivity, so the binaries always describe one total order per worker:
        # along each chain (monotone) and across the three chains (no 3-cycle F<B<W<F).
        for ka, kb in PAIRS:
            for i in range(m):
                for j in range(i):
                    if i + 1 < m:  # ka_{i+1} before kb_j  =>  ka_i before kb_j
                        add((1, rel(s, ka, i, kb, j)), (-1, rel(s, ka, i + 1, kb, j)), lo=0)
                    if j + 1 < i:  # ka_i before kb_j  =>  ka_i before kb_{j+1}
                        add((1, rel(s, ka, i, kb, j + 1)), (-1, rel(s, ka, i, kb, j)), lo=0)
        for i in range(m):
            for k in range(i):
                for j in range(m):
                    fb, bw, fw = rel(s, 0, i, 1, j), rel(s, 1, j, 2, k), rel(s, 0, i, 2, k)
                    add((1, fw), (-1, fb), (-1, bw), lo=-1)  # F<B and B<W => F<W
                    add((1, fw), (-1, fb), (-1, bw), hi=0)  # W<B and B<F => W<F
        f, b, w = (prob.d(k, s) for k in range(3))
        for j in range(m):
            # Energy cuts: the work of worker s that must follow each op fits before T.
            add(
                (1, (0.0, {T: 1.0, prob.idx(0, s, j): -1.0})),
                *((-b, rel(s, 0, j, 1, k)) for k in range(j)),
                *((-w, rel(s, 0, j, 2, k)) for k in range(j)),
                lo=prob.load_from(0, s, j),
            )
            add(
                (1, (0.0, {T: 1.0, prob.idx(1, s, j): -1.0})),
                *((f, rel(s, 0, i, 1, j)) for i in range(j + 1, m)),
                *((-w, rel(s, 1, j, 2, k)) for k in range(j)),
                lo=prob.load_from(1, s, j) + f * (m - j - 1),
            )
            add(
                (1, (0.0, {T: 1.0, prob.idx(2, s, j): -1.0})),
                *((f, rel(s, 0, i, 2, j)) for i in range(j + 1, m)),
                *((b, rel(s, 1, i, 2, j)) for i in range(j + 1, m)),
                lo=prob.load_from(2, s, j) + (f + b) * (m - j - 1),
            )
        if limit is not None:  # memory after F_i: (i+1) - (B's and W's before it)/2 <= limit
            halves = limit_units(limit - 1, chunks=1)  # room left beside F_i's own, v = 1
            for i in range(halves // 2 + 1, m):
                add(
                    *((1, rel(s, 0, i, 1, j)) for j in range(i)),
                    *((1, rel(s, 0, i, 2, j)) for j in range(i)),
                    hi=halves,
                )
    return model, T, x
