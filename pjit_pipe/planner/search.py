"""The fast planner: a partition DP combined with a device-mapping search, checked by the simulator.

For every shape D x P that fits the devices (or the one asked for):

1. Mapping seeds. Devices are ordered along a greedy chain of fast links
   (start at the best-connected device, then always the unused device with the
   fastest link to the last one); the first D*P of them fill the D x P grid
   row-major (a replica's stages are neighbours on the chain) and column-major
   (a stage's replicas are neighbours).
2. Alternation. The partition DP (`pjit_pipe.planner.partition`) cuts the
   layers for the current mapping (a candidate); a swap search then exchanges
   pairs of devices (placed or unused) while the proxy period plus the
   largest all-reduce improves (another candidate); repeat until the cut
   stops changing.
3. Pricing. The best candidates by proxy are priced by the event simulator
   under every schedule kind that fits memory (or the one asked for); the
   best of each of the best shapes is then improved by hill climbing on the
   simulated period (moving a cut by one layer, swapping two devices, another
   kind), restarting at a local optimum from that shape's next priced plans,
   then from random kicks, while the budget lasts.

The objective is the time per replica's microbatch: period / D. With D fixed it
is the period; when the replicas are free it compares shapes that process
D x m microbatches per iteration fairly (throughput).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pjit_pipe.planner.cost import (
    PLANNABLE_KINDS,
    CostModel,
    Evaluation,
    Plan,
    PlanError,
    peak_inflight,
)
from pjit_pipe.planner.partition import Partitioner, even_cuts, positions

TOP_CANDIDATES = 4  # candidates (best proxy first) always priced by the simulator
POOL_OPS = 50_000  # ... and more of them while their simulations stay within this many ops
ALL_SHAPES_UP_TO = 8  # devices; beyond, a free search keeps to shapes with D * P = N
MAX_SWAP_PASSES = 32  # improving swaps per swap search
ENUMERATE_PLACEMENTS = 720  # shapes with at most this many device permutations try them all
PER_SHAPE = 24  # candidates kept per shape
LINK_WEIGHTS = (0.5, 0.0)  # the partition proxy's k (pjit_pipe.planner.partition)
CLIMBS = 3  # hill climbs, each from the best simulated plan of a different shape
CLIMB_OPS = 50_000  # ops the hill climbs may simulate in all (about 1.5 s of simulation)
CLIMB_SIMS = (20, 400)  # ... but at least / at most this many simulations


@dataclass(frozen=True)
class Candidate:
    """A partition and mapping with its proxy score (per replica's microbatch)."""

    cuts: tuple[int, ...]
    mapping: tuple[tuple[int, ...], ...]
    score: float


def shapes(devices: int, layers: int, stages: int | None, replicas: int | None):
    """Every (D, P) with D * P <= devices and P <= layers, or the fixed ones asked for.

    With more than ALL_SHAPES_UP_TO devices and both free, only shapes that use
    every device (D * P = N) are tried: leaving devices idle rarely pays there.
    """
    ps = [stages] if stages else range(1, min(devices, layers) + 1)
    for p in ps:
        ds = [replicas] if replicas else range(1, devices // p + 1)
        for d in ds:
            if d * p > devices or p > layers:
                continue
            if not (stages or replicas) and devices > ALL_SHAPES_UP_TO and d * p != devices:
                continue
            yield d, p


def placements(devices: int, replicas: int, stages: int):
    """D x P grids of distinct device ids, one per set of interchangeable replicas
    (rows start with increasing device ids)."""
    for ids in itertools.permutations(range(devices), replicas * stages):
        rows = tuple(ids[r * stages : (r + 1) * stages] for r in range(replicas))
        if all(rows[r][0] < rows[r + 1][0] for r in range(replicas - 1)):
            yield rows


def chain_order(model: CostModel) -> list[int]:
    """Devices along a greedy chain of fast links (see the module docstring)."""
    mpb = model.ms_per_byte
    slow = np.maximum(mpb, mpb.T)  # a link is as fast as its slower direction
    n = len(slow)
    if n == 1:
        return [0]
    speed = 1 / np.where(np.eye(n, dtype=bool), np.inf, slow)
    order = [int(np.argmax(speed.sum(axis=1)))]
    while len(order) < n:
        last = order[-1]
        rest = [d for d in range(n) if d not in order]
        order.append(max(rest, key=lambda d: (speed[last, d], -d)))
    return order


class Searcher:
    """The fast search over one cost model (see the module docstring)."""

    def __init__(self, model: CostModel):
        self.model = model
        self.m = model.microbatches
        self.part = Partitioner(model, self.m)
        self.n_dev = len(model.devices)
        self.order = chain_order(model)
        self.params = np.concatenate([[0.0], np.cumsum(model.profile.param_bytes)])

    # ---- proxy phase -------------------------------------------------------
    def score(self, cuts, mapping, peaks, link_weight: float) -> float:
        """Proxy period plus the largest all-reduce, per replica's microbatch."""
        pos = positions(self.model, mapping)
        proxy = self.part.proxy_of(cuts, pos, peaks, link_weight)
        if not np.isfinite(proxy):
            return proxy
        bounds = np.array((0, *cuts, self.part.n))
        params = self.params[bounds[1:]] - self.params[bounds[:-1]]
        return (proxy + self.model.allreduce(mapping, params).max()) / len(mapping)

    def improve_mapping(self, cuts, mapping, peaks, link_weight: float):
        """First-improvement swaps of two placed devices or a placed and an unused one."""
        mapping = [list(r) for r in mapping]
        best = self.score(cuts, mapping, peaks, link_weight)
        D, P = len(mapping), len(mapping[0])
        cells = [(r, p) for r in range(D) for p in range(P)]
        improved, passes = True, 0
        while improved and passes < MAX_SWAP_PASSES:
            improved, passes = False, passes + 1
            used = {d for row in mapping for d in row}
            unused = [d for d in range(self.n_dev) if d not in used]
            moves = [(a, b) for a, b in itertools.combinations(cells, 2) if a[0] != b[0]]
            moves += [(a, b) for a, b in itertools.combinations(cells, 2) if a[0] == b[0]]
            moves += [(a, d) for a in cells for d in unused]
            for a, b in moves:
                trial = [list(r) for r in mapping]
                if isinstance(b, tuple):
                    trial[a[0]][a[1]], trial[b[0]][b[1]] = mapping[b[0]][b[1]], mapping[a[0]][a[1]]
                else:
                    trial[a[0]][a[1]] = b
                s = self.score(cuts, trial, peaks, link_weight)
                if s < best * (1 - 1e-9):
                    mapping, best, improved = trial, s, True
                    break
        return mapping, best

    def seeds(self, D: int, P: int) -> list[list[list[int]]]:
        chain = self.order[: D * P]
        row_major = [chain[r * P : (r + 1) * P] for r in range(D)]
        col_major = [[chain[p * D + r] for p in range(P)] for r in range(D)]
        return [row_major] if row_major == col_major else [row_major, col_major]

    def for_shape(self, D: int, P: int, kind: str) -> list[Candidate]:
        """Candidates of one shape, best proxy first (empty if none fits).

        With few device permutations (at most ENUMERATE_PLACEMENTS) every placement
        is cut by the DP;
        otherwise each seed alternates DP and swap search.
        """
        peaks = peak_inflight(kind, P, self.m)
        out: set[Candidate] = set()
        even = even_cuts(self.model.profile.work, P)  # the even-compute split competes too
        # placements() walks every permutation of D*P devices: bound those, not the canonical ones
        if math.perm(self.n_dev, D * P) <= ENUMERATE_PLACEMENTS:
            for mapping, link_weight in itertools.product(
                placements(self.n_dev, D, P), LINK_WEIGHTS
            ):
                found = self.part.best(positions(self.model, mapping), peaks, link_weight)
                for cuts in {found[0] if found else None, even} - {None}:
                    score = self.score(cuts, mapping, peaks, link_weight)
                    if np.isfinite(score):
                        out.add(Candidate(cuts, mapping, score))
            return sorted(out, key=lambda c: (c.score, c.mapping, c.cuts))[:PER_SHAPE]
        for seed in self.seeds(D, P):
            score = self.score(even, seed, peaks, 0.5)
            if np.isfinite(score):
                out.add(Candidate(even, tuple(map(tuple, seed)), score))
        for seed, link_weight in itertools.product(self.seeds(D, P), LINK_WEIGHTS):
            mapping, cuts = seed, None
            for _ in range(4):
                found = self.part.best(positions(self.model, mapping), peaks, link_weight)
                if found is None:
                    break
                new_cuts = found[0]
                # the DP's cut on this mapping competes too: the swaps improve the
                # proxy, which can rank a worse simulated period first
                score = self.score(new_cuts, mapping, peaks, link_weight)
                if np.isfinite(score):
                    out.add(Candidate(new_cuts, tuple(map(tuple, mapping)), score))
                mapping, score = self.improve_mapping(new_cuts, mapping, peaks, link_weight)
                out.add(Candidate(new_cuts, tuple(map(tuple, mapping)), score))
                if new_cuts == cuts:
                    break
                cuts = new_cuts
        return sorted(out, key=lambda c: (c.score, c.mapping, c.cuts))[:PER_SHAPE]

    # ---- simulator phase ---------------------------------------------------
    def objective(self, ev: Evaluation) -> float:
        return ev.period / ev.plan.replicas if ev.feasible else float("inf")

    def evaluate(self, plan: Plan) -> Evaluation:
        return self.model.evaluate(plan, iterations=1)

    def mapping_moves(self, plan: Plan) -> list[Plan]:
        """`plan` with two devices swapped, or one replaced by an unused device."""
        flat = [d for row in plan.mapping for d in row]
        unused = [d for d in range(self.n_dev) if d not in flat]
        out = []
        for i, j in itertools.combinations(range(len(flat)), 2):
            swapped = list(flat)
            swapped[i], swapped[j] = flat[j], flat[i]
            out.append(self._with_flat(plan, swapped))
        for i in range(len(flat)):
            for d in unused:
                moved = list(flat)
                moved[i] = d
                out.append(self._with_flat(plan, moved))
        return out

    def neighbours(self, plan: Plan, kinds: list[str], vary: str = "all") -> Iterator[Plan]:
        """Plans one move away, lazily: another kind, a cut moved by one layer, or a
        mapping move (`mapping_moves`). vary="cuts" or "mapping" keeps the rest fixed."""
        n = len(self.model.profile)
        yield from (Plan(plan.stages, plan.mapping, k) for k in kinds if k != plan.schedule)
        cuts = tuple(s[0] for s in plan.stages[1:]) if vary != "mapping" else ()
        for k in range(len(cuts)):
            for step in (-1, 1):
                new = list(cuts)
                new[k] += step
                lo = new[k - 1] if k else 0
                hi = new[k + 1] if k + 1 < len(new) else n
                if lo < new[k] < hi:
                    yield Plan.from_cuts(tuple(new), n, plan.mapping, plan.schedule)
        if vary != "cuts":
            yield from self.mapping_moves(plan)

    def recut(self, plan: Plan) -> list[Plan]:
        """`plan` with the partition DP's cuts for its mapping (one per link weight)."""
        peaks = peak_inflight(plan.schedule, plan.num_stages, self.m)
        out = []
        for link_weight in LINK_WEIGHTS:
            found = self.part.best(positions(self.model, plan.mapping), peaks, link_weight)
            if found is not None:
                out.append(
                    Plan.from_cuts(found[0], len(self.model.profile), plan.mapping, plan.schedule)
                )
        return out

    def climb(
        self,
        start: Evaluation,
        budget: int,
        kinds: list[str],
        vary: str = "all",
        restarts: tuple[Evaluation, ...] = (),
    ) -> Evaluation:
        """Iterated local search on the simulated period.

        First-improvement hill climbing over `neighbours`; at a local optimum it
        restarts from the next of `restarts` (already simulated plans, best
        first) not yet visited, then, once they are used up, from a kick (a
        random mapping move from the best plan, re-cut by the DP unless
        vary="mapping"; seeded, so the search is deterministic), until `budget`
        simulations are spent. vary="cuts" only climbs.

        The restarts matter: the runner-up of the pool is often one move from
        the optimum when the best is a local optimum far from it (the proxy
        ranks by 1F1B's steady state; the simulator prices the kind's own
        bubbles), and a random kick rarely finds that move.
        """
        rng = np.random.default_rng(0)
        best = current = start
        seen = {start.plan}
        pending = list(restarts)
        while budget > 0:
            improved = False
            for cand in self.neighbours(current.plan, kinds, vary):
                if budget <= 0:
                    break
                if cand in seen or not self.model.fits(cand):
                    continue
                seen.add(cand)
                budget -= 1
                ev = self.evaluate(cand)
                if self.objective(ev) < self.objective(current) * (1 - 1e-9):
                    current, improved = ev, True
                    break
            if self.objective(current) < self.objective(best):
                best = current
            if improved:
                continue
            pending = [ev for ev in pending if ev.plan not in seen]
            if pending:
                current = pending.pop(0)
                seen.add(current.plan)
                continue
            moves = self.mapping_moves(best.plan) if vary != "cuts" else []
            if not moves:
                break  # nothing to perturb
            kicked = moves[int(rng.integers(len(moves)))]
            recuts = (self.recut(kicked) if vary == "all" else []) or [kicked]
            kick = recuts[int(rng.integers(len(recuts)))]
            if kick in seen or not self.model.fits(kick):
                budget -= 1  # a wasted kick still counts, so the loop ends
                continue
            seen.add(kick)
            budget -= 1
            current = self.evaluate(kick)
        return best

    def sim_size(self, plan: Plan) -> int:
        """About how many ops simulating `plan` executes (what a simulation costs)."""
        return plan.replicas * plan.num_stages * (3 * self.m + 1)

    def climb_budget(self, plan: Plan, ops: int) -> int:
        """Simulations worth `ops` simulated ops at `plan`'s size, within CLIMB_SIMS."""
        return int(np.clip(ops // self.sim_size(plan), *CLIMB_SIMS))

    @staticmethod
    def _with_flat(plan: Plan, flat: list[int]) -> Plan:
        P = plan.num_stages
        rows = tuple(tuple(flat[r * P : (r + 1) * P]) for r in range(plan.replicas))
        return Plan(plan.stages, rows, plan.schedule)

    def search(
        self,
        stages: int | None = None,
        replicas: int | None = None,
        schedule: str | None = None,
        pool_ops: int = POOL_OPS,
        climb_ops: int = CLIMB_OPS,
    ) -> Evaluation:
        """The best plan found (raises PlanError when no plan fits in memory)."""
        n_layers = len(self.model.profile)
        kinds = [schedule] if schedule else list(PLANNABLE_KINDS)
        dp_kind = kinds[0]  # 1f1b first: the smallest activation memory of them all
        found: list[Candidate] = []
        total = float(self.model.profile.work.sum()) / float(self.model.devices.speed.max())
        bound = {  # no proxy score of a shape is lower (perfect balance, no bubble or link)
            (D, P): ((self.m - 1) / P + 1) * total / D
            for D, P in shapes(self.n_dev, n_layers, stages, replicas)
        }
        for (D, P), low in sorted(bound.items(), key=lambda kv: kv[1]):
            scores = sorted(c.score for c in found)
            if len(scores) >= TOP_CANDIDATES and low >= scores[TOP_CANDIDATES - 1]:
                break  # every remaining shape's bound is higher still
            found += self.for_shape(D, P, dp_kind)
        found.sort(key=lambda c: c.score)
        evaluated, spent = [], 0
        for rank, cand in enumerate(found):
            if rank >= TOP_CANDIDATES and spent >= pool_ops:
                break
            for kind in kinds:
                plan = Plan.from_cuts(cand.cuts, n_layers, cand.mapping, kind)
                if self.model.fits(plan):
                    evaluated.append(self.evaluate(plan))
                    spent += self.sim_size(plan)
        evaluated = sorted((e for e in evaluated if e.feasible), key=self.objective)
        if not evaluated:
            raise PlanError("no plan fits in memory")
        by_shape: dict[tuple[int, int], list[Evaluation]] = {}
        for ev in evaluated:  # climb from the best plan of each of the best shapes
            by_shape.setdefault((ev.plan.replicas, ev.plan.num_stages), []).append(ev)
        starts = list(by_shape.values())[:CLIMBS]
        best = min(
            (
                self.climb(
                    pool[0],
                    self.climb_budget(pool[0].plan, climb_ops) // len(starts),
                    kinds,
                    restarts=tuple(pool[1:]),
                )
                for pool in starts
            ),
            key=self.objective,
        )
        return self.model.evaluate(best.plan)  # the steady period over two iterations
