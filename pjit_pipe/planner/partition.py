"""Contiguous partitions by dynamic programming, for a fixed device mapping.

Given a mapping, pipeline position p has an effective speed (its slowest
replica's device), memory (its smallest device) and, towards position p+1, an
effective link (its slowest replica's link, either direction). Cutting the
layers i..j-1 onto position p then costs s_p = work(i..j-1) / speed_p, and a
cut at j between positions p and p+1 costs c_p = 2 * bytes(j) * ms_per_byte_p
for the activation and its gradient.

The search minimises a proxy of the event simulator's period,
    (m - 1) * max_p max(s_p, k * c_p) + sum_p (s_p + c_p),
the steady state of the busiest stage or link plus one microbatch's fill and
drain. k weighs how much a slow link holds the steady state back: 1/2 (a
one-way transfer per microbatch, as in 1F1B's tight loop between neighbours)
or 0 (schedules with enough warm-up forwards hide it); the search tries both.
It is not decomposable, so `best_partition` first finds the smallest
feasible bottleneck T* by a min-max DP, then for a few thresholds T >= T*
minimises the sum subject to every term <= T, and keeps the best proxy. The
simulator judges the candidates afterwards (`pjit_pipe.planner.search`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pjit_pipe.planner.cost import STATE_COPIES, CostModel

THRESHOLDS = (1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.6, 2.0)


def even_cuts(work: np.ndarray, stages: int) -> tuple[int, ...]:
    """The even-compute split: cut where the running work crosses k/P of the total
    (every stage keeps at least one layer)."""
    prefix = np.cumsum(work)
    cuts, last = [], 0
    for k in range(1, stages):
        j = int(np.searchsorted(prefix, k * prefix[-1] / stages)) + 1
        j = min(max(j, last + 1), len(work) - (stages - k))
        cuts.append(j)
        last = j
    return tuple(cuts)


@dataclass(frozen=True)
class Positions:
    """What a mapping makes of each pipeline position (see the module docstring)."""

    speed: np.ndarray  # (P,) slowest device speed per position
    memory: np.ndarray  # (P,) smallest device memory per position, bytes
    link: np.ndarray  # (P-1,) slowest ms per byte from position p to p+1, either way


def positions(model: CostModel, mapping) -> Positions:
    cols = np.asarray(mapping)  # (D, P) device ids
    mpb = model.ms_per_byte
    a, b = cols[:, :-1], cols[:, 1:]
    link = np.maximum(mpb[a, b], mpb[b, a]).max(axis=0)
    dev = model.devices
    return Positions(dev.speed[cols].min(axis=0), dev.memory[cols].min(axis=0), link)


class Partitioner:
    """Segment tables of one cost model, shared by every DP over it."""

    def __init__(self, model: CostModel, microbatches: int):
        self.model, self.m = model, microbatches
        n = len(model.profile)
        self.n = n
        work = np.concatenate([[0.0], np.cumsum(model.profile.work)])
        act = np.concatenate([[0.0], np.cumsum(model.profile.act_bytes)])
        par = np.concatenate([[0.0], np.cumsum(model.profile.param_bytes)])
        i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
        self.valid = i < j  # segment [i, j) is non-empty
        self.work = np.where(self.valid, work[j] - work[i], np.inf)
        self.act = act[j] - act[i]
        self.state = STATE_COPIES * (par[j] - par[i])
        # bytes of a cut at j (between layers j-1 and j); no cut at 0 or n
        self.cut = np.concatenate([[0.0], model.cut, [0.0]])

    def _tables(self, pos: Positions, peaks: tuple[float, ...]):
        """Per position: stage time s[i, j] (inf if infeasible) and cut cost c[j]."""
        P = len(pos.speed)
        stage, comm = [], []
        for p in range(P):
            fits = self.valid & (self.state + peaks[p] * self.act <= pos.memory[p])
            stage.append(np.where(fits, self.work / pos.speed[p], np.inf))
            comm.append(2 * self.cut * pos.link[p] if p < P - 1 else np.zeros(self.n + 1))
        return stage, comm

    def best(
        self, pos: Positions, peaks: tuple[float, ...], link_weight: float
    ) -> tuple[tuple[int, ...], float] | None:
        """(cut positions, proxy) of the best partition onto `pos`, or None if none fits."""
        stage, comm = self._tables(pos, peaks)
        P, n = len(stage), self.n
        if n < P:
            return None
        # bottleneck of stage p on [i, j) including its outgoing link: max(s, c/2)
        neck = [np.maximum(stage[p], link_weight * comm[p][None, :]) for p in range(P)]
        g = neck[0][0].copy()
        for p in range(1, P):
            g = np.min(np.maximum(g[:, None], neck[p]), axis=0)
        t_star = g[n]
        if not np.isfinite(t_star):
            return None
        best: tuple[tuple[int, ...], float] | None = None
        for factor in THRESHOLDS:
            found = self._min_sum(stage, comm, neck, t_star * factor * (1 + 1e-12))
            if found is None:
                continue
            cuts = found
            proxy = self.proxy(cuts, stage, comm, link_weight)
            if best is None or proxy < best[1] - 1e-12:
                best = (cuts, proxy)
        return best

    def _min_sum(self, stage, comm, neck, limit: float) -> tuple[int, ...] | None:
        P, n = len(stage), self.n
        h = np.where(neck[0][0] <= limit, stage[0][0] + comm[0], np.inf)
        back = []
        for p in range(1, P):
            total = h[:, None] + np.where(neck[p] <= limit, stage[p] + comm[p][None, :], np.inf)
            arg = np.argmin(total, axis=0)
            back.append(arg)
            h = total[arg, np.arange(n + 1)]
        if not np.isfinite(h[n]):
            return None
        cuts, j = [], n
        for arg in reversed(back):
            j = int(arg[j])
            cuts.append(j)
        return tuple(reversed(cuts))

    def proxy(self, cuts: tuple[int, ...], stage, comm, link_weight: float) -> float:
        bounds = (0, *cuts, self.n)
        s = [stage[p][bounds[p], bounds[p + 1]] for p in range(len(stage))]
        c = [comm[p][bounds[p + 1]] for p in range(len(stage))]
        neck = max(max(s), link_weight * max(c))
        return (self.m - 1) * neck + sum(s) + sum(c)

    def proxy_of(
        self, cuts: tuple[int, ...], pos: Positions, peaks: tuple[float, ...], link_weight: float
    ) -> float:
        """The proxy of given cuts on `pos` (inf if a stage does not fit its memory)."""
        bounds = (0, *cuts, self.n)
        P = len(pos.speed)
        s, c = [], []
        for p in range(P):
            i, j = bounds[p], bounds[p + 1]
            if i >= j or self.state[i, j] + peaks[p] * self.act[i, j] > pos.memory[p]:
                return float("inf")
            s.append(self.work[i, j] / pos.speed[p])
            c.append(2 * self.cut[j] * pos.link[p] if p < P - 1 else 0.0)
        return (self.m - 1) * max(max(s), link_weight * max(c)) + sum(s) + sum(c)
