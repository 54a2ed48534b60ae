"""Lower bounds: what no schedule, and no tick table, can beat.

`lower_bound` (work-conserving, under a failure pattern) is what re-routed
schedules are measured against (tests, benchmarks) and where the
failure-aware search stops early; `slow_bound` is its counterpart with slow
workers (whole microbatch-slices over workers of different speeds), and
`fill_bound` adds each worker's pipeline fill at a memory limit.
`lockstep_lower_bound` is what no tick table of a schedule can beat
(tick_packing/packer.py stops at it).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from graphlib import TopologicalSorter

from pjit_pipe.ir.costs import Costs
from pjit_pipe.ir.engine import Engine, Tensor
from pjit_pipe.ir.failures import FailurePattern
from pjit_pipe.ir.ops import COMM_KINDS, Kind, Worker
from pjit_pipe.ir.schedule import Schedule
from pjit_pipe.ir.ticks import W_PER_TICK, compute_only, is_message


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def lower_bound(
    stages: int,
    microbatches: int,
    replicas: int,
    failed: FailurePattern | Iterable[tuple[int, int]] = (),
    costs: Costs | None = None,
    chunks: int = 1,
) -> float:
    """Work-conserving bound on the steady iteration period.

    The larger of the fault-free bound and the load of the busiest surviving
    worker: a stage with k failed replicas spreads its D*m microbatches over
    D-k workers, one of which gets ceil(D*m/(D-k)) whole microbatches (plus
    the optimizer steps of its `chunks` chunks). The fault-free bound is the
    larger of the ideal m*(F+B+W) and one microbatch's round trip: stage 0
    cannot start an iteration before its optimizer has the previous one's
    gradients, which need every stage's F and B of one microbatch (and at
    least 2(P-1) transfers) and its own W.
    """
    costs = costs or Costs()
    pattern = FailurePattern.of(replicas, stages, failed)
    per_stage = costs.per_stage(stages)
    total = replicas * microbatches
    steps = chunks * costs.opt
    round_trip = sum(f + b for f, b, _ in per_stage) + per_stage[0][2] / chunks
    round_trip += 2 * (stages - 1) * costs.c + costs.opt
    busiest = max(
        _ceil_div(total, len(pattern.survivors(p))) * sum(per_stage[p]) for p in range(stages)
    )
    return max(round_trip, busiest + steps)


def least_largest_load(items: int, unit: Sequence[float]) -> tuple[float, list[int]]:
    """The least possible largest load when `items` identical items are dealt to
    workers that take unit[i] each, and how many each may then take.

    Exact: the optimum is some worker's k * unit[i] (its load with k items), and
    whether a largest load T is reachable is monotone in T (worker i fits
    floor(T / unit[i]) items), so a binary search over those candidates finds
    the least reachable one.

    Args:
        items: How many items (>= 0).
        unit: Each worker's time per item (>= 0); at least one worker.

    Returns:
        (T, caps): the least largest load, and caps[i] the items worker i fits
        within T (they add up to at least `items`).
    """
    if items <= 0:
        return 0.0, [0] * len(unit)
    if min(unit) <= 0:  # a free worker takes everything at no cost
        free = unit.index(min(unit))
        return 0.0, [items if i == free else 0 for i in range(len(unit))]

    def caps(limit: float) -> list[int]:
        return [math.floor(limit / u * (1 + 1e-12) + 1e-9) for u in unit]

    candidates = sorted({k * u for u in unit for k in range(1, items + 1)})
    lo, hi = 0, len(candidates) - 1  # the largest candidate always fits: one worker takes all
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(caps(candidates[mid])) >= items:
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo]), caps(candidates[lo])


def slow_bound(
    stages: int,
    microbatches: int,
    replicas: int,
    slow: Mapping[tuple[int, int], float] | None = None,
    failed: FailurePattern | Iterable[tuple[int, int]] = (),
    costs: Costs | None = None,
) -> float:
    """What no schedule's steady period can beat with slow (and failed) workers.

    Per stage, the D*m microbatch-slices of a pipeline position (all its chunks
    of one microbatch) run on the position's live workers; a worker's load is
    its slices' F+B+W times its factor. The bound of a stage is the least
    possible largest load over its workers when whole slices are assigned
    (`least_largest_load`); the bound is the largest over stages.

    Args:
        stages: P.
        microbatches: m per replica.
        replicas: D.
        slow: {(replica, stage): factor >= 1}; None: `costs.slow` (or none).
        failed: Failed workers: they take no slice.
        costs: F, B, W per position (default unit costs).

    Returns:
        The bound, in the units of `costs`.

    Raises:
        FailurePlanError: A stage lost every replica.
        ScheduleError: Bad costs or factors.
    """
    costs = costs or Costs()
    live = _live_factors(stages, replicas, slow, failed, costs)
    work = [sum(row) for row in costs.per_stage(stages)]
    return max(
        least_largest_load(replicas * microbatches, [work[p] * f for f in live[p]])[0]
        for p in range(stages)
    )


def _live_factors(
    stages: int,
    replicas: int,
    slow: Mapping[tuple[int, int], float] | None,
    failed: FailurePattern | Iterable[tuple[int, int]],
    costs: Costs,
) -> list[list[float]]:
    """Per stage, the speed factor of each live worker (`slow`; None: `costs.slow`)."""
    speeds = costs.factors() if slow is None else Costs(slow=slow).factors()
    pattern = FailurePattern.of(replicas, stages, failed)
    return [[speeds.get(Worker(r, p), 1.0) for r in pattern.survivors(p)] for p in range(stages)]


def fill_bound(
    stages: int,
    microbatches: int,
    replicas: int,
    mem_limit: float,
    slow: Mapping[tuple[int, int], float] | None = None,
    failed: FailurePattern | Iterable[tuple[int, int]] = (),
    costs: Costs | None = None,
) -> float:
    """`slow_bound` with each worker's pipeline fill at a memory limit: what no
    synchronous schedule of one chunk per device can beat within `mem_limit`.

    Why it holds. A worker starts each iteration with no activations: the OPT
    of its stage follows every W of the iteration, and its next forward
    follows the OPT. Its first backward needs a microbatch's round trip: its
    own F, then F and B on every later stage (at the speed of that stage's
    fastest live worker) and 2 transfers a later stage. Until then it can
    only run forwards, at most floor(mem_limit) of them (each holds one
    microbatch's activations) and no more than its n slices. So a worker
    with n >= 1 slices of stage p idles at least max(0, round trip -
    min(floor(mem_limit), n) x F_p x factor) every iteration, beside its load
    n x (F+B+W)_p x factor (each op at the cheaper of its split and fused
    cost, `Costs.f_fused`, `Costs.bw`). Per stage, the least possible
    largest of those times over whole-slice assignments (exact, as
    `least_largest_load`: each worker's time grows with n); the bound is the
    largest over stages.

    Example (1F1B, D=4, P=4, m=8, unit costs, worker 0:1 at factor 1.5,
    mem_limit 4): a fast stage-1 worker's round trip is 1 + 2 x 2 = 5, so it
    idles 5 - 4 = 1 an iteration; 32 slices need one with 9 (3 x 9 + 1 = 28)
    unless the slow one takes 7 (31.5). The bound is 28; `slow_bound` is 27.

    Args:
        stages: P.
        microbatches: m per replica.
        replicas: D.
        mem_limit: Each worker's activation memory limit (docs/design.md units).
        slow: {(replica, stage): factor >= 1}; None: `costs.slow` (or none).
        failed: Failed workers: they take no slice.
        costs: F, B, W per position and C (default unit costs).

    Returns:
        The bound, in the units of `costs`; at least `slow_bound`.

    Raises:
        FailurePlanError: A stage lost every replica.
        ScheduleError: Bad costs or factors.
    """
    costs = costs or Costs()
    live = _live_factors(stages, replicas, slow, failed, costs)
    # Per position the cheaper of the split and the fused ops: F, the backward
    # (B, or BW where a schedule fuses it) and one slice's F+B+W (or F+BW).
    fused = costs.fused_per_stage(stages)
    table = [
        (min(f, ff), min(b, bw), min(f + b + w, ff + bw))
        for (f, b, w), (ff, bw) in zip(costs.per_stage(stages), fused, strict=True)
    ]
    total, room = replicas * microbatches, math.floor(mem_limit + 1e-9)
    bound = 0.0
    for p in range(stages):
        forward, work = table[p][0], table[p][2]
        later = sum(
            (f + b) * min(live[t]) + 2 * costs.c for t, (f, b, _) in enumerate(table) if t > p
        )
        times = []  # per live worker, its time with n = 0, 1, ... slices (non-decreasing)
        for factor in live[p]:
            fill = [
                max(0.0, later - (min(room, n) - 1) * forward * factor) for n in range(total + 1)
            ]
            times.append([n * work * factor + fill[n] if n else 0.0 for n in range(total + 1)])
        for limit in sorted({t for row in times for t in row}):
            if sum(bisect.bisect_right(row, limit + 1e-9) - 1 for row in times) >= total:
                bound = max(bound, limit)
                break
    return bound


def lockstep_lower_bound(schedule: Schedule, costs: Costs | None = None) -> float:
    """A price that no tick table of one iteration of `schedule` can beat: not the
    packer's, not the exact engine's, under any lane order and any memory limit.

    For a synchronous schedule it bounds `lockstep_period` (behind the barrier an
    iteration's table is priced alone), so a table that reaches it is optimal and
    a ratio to the event-driven period above it is out of every table's reach.

    Why it holds. A tick lasts at least as long as each worker's ops in it
    (simulate.packed_events; a message's transfer C is not counted: a deferred
    table, ir/ticks.py, can hide it behind the receiver's first lane). Fix a
    worker d; its own ops add up to work(d) over the ticks
    it runs them in. Two kinds of ticks cost more than d's share:
    - before d's first op of a class K (its ops of one kind and stage, or all
      of them), a chain of messages leads to that op, one tick per link, and in
      those ticks d can only run ops that are neither in K nor come after one;
    - after d's last op of K, the chain of messages it starts runs on, and d
      can only run ops that are neither in K nor lead to one.
    In such a tick d runs what ir/ticks.py's rule lets one tick hold, so at
    most `cap` (the dearest such set of those ops); a chain op of duration
    x makes the tick cost at least x, so the tick exceeds d's share by at least
    max(0, x - cap). The bound is work(d) plus the smaller of those excesses
    over the ops of K that could come first (last), maximized over workers and
    classes, plus `costs.tick` for each tick the longest chain needs.

    Example (zb-h2, P=4, m=8, costs 1,3,1,0): the last stage waits 3 ticks for
    its first forward and does 8 x 5, and after its last B the gradient still
    crosses 3 stages, each tick holding a B (3) while the last stage has only
    W's left, two a tick (2): 3 + 40 + 3 x (3 - 2) = 46. With one W a tick (the
    rule before ir.ticks.W_PER_TICK), costs 1,2,1,0 gave 3 + 32 + 3 = 38 where
    the event-driven period is 35, and the packer's table cost 38.
    """
    return _LockstepBound(schedule, costs or Costs()).value()


class _LockstepBound:
    """The DAG of one iteration's ops and the bound of `lockstep_lower_bound`."""

    def __init__(self, schedule: Schedule, costs: Costs):
        sched = compute_only(schedule)
        flow, duration = Engine(sched), costs.duration_fn(sched)
        self.costs = costs
        self.nodes = [(w, op) for w, _, op in sched.ops() if op.kind not in COMM_KINDS]
        makers: dict = {}
        for i, n in enumerate(self.nodes):
            for key in flow.produces(*n):
                makers.setdefault(key, []).append(i)
        n_ops = len(self.nodes)
        # preds[i] / succs[i]: (op index, whether the edge is a message: a later tick)
        self.preds: list[list[tuple[int, bool]]] = [[] for _ in range(n_ops)]
        self.succs: list[list[tuple[int, bool]]] = [[] for _ in range(n_ops)]
        for i, (w, op) in enumerate(self.nodes):
            for key, _ in flow.deps(w, op):
                for p in makers.get(key, ()):
                    # A gradient sum (W/BW -> OPT) may end in the same tick.
                    message = isinstance(key, Tensor) and (
                        self.nodes[p][0] != w or is_message(key, op)
                    )
                    self.preds[i].append((p, message))
                    self.succs[p].append((i, message))
        # A loss-stage op may run fused (ir.ticks.fused_loss_ops): its least price.
        fused = min(1.0, costs.loss_fusion(sched))
        last = sched.num_virtual_stages - 1
        self.duration = [
            duration(w, op) * (fused if op.stage == last and op.kind is not Kind.OPT else 1.0)
            for w, op in self.nodes
        ]
        # Each op after everything it waits for.
        graph = {i: [p for p, _ in self.preds[i]] for i in range(n_ops)}
        self.order = list(TopologicalSorter(graph).static_order())
        self.before = [0] * n_ops  # bit masks: the ops each op (transitively) waits for
        for i in self.order:
            for p, _ in self.preds[i]:
                self.before[i] |= self.before[p] | (1 << p)
        self.after = [0] * n_ops  # and the ops that wait for it
        for i in reversed(self.order):
            for s, _ in self.succs[i]:
                self.after[i] |= self.after[s] | (1 << s)

    def value(self) -> float:
        best = 0.0
        for d in sorted({w for w, _ in self.nodes}):
            mine = [i for i, (w, _) in enumerate(self.nodes) if w == d]
            classes: dict = {}
            for i in mine:
                op = self.nodes[i][1]
                classes.setdefault((op.kind, op.stage), []).append(i)
            heads, tails = [], []
            for members in [mine, *classes.values()]:
                inside = sum(1 << i for i in members)
                reached = successors = 0
                for i in members:
                    reached |= self.before[i]
                    successors |= self.after[i]
                heads.append(self._excess(d, members, mine, inside | successors, backward=True))
                tails.append(self._excess(d, members, mine, inside | reached, backward=False))
            # Head and tail ticks must not overlap: both of one class, or one of them of all ops.
            extra = max(
                max(heads[0] + t for t in tails),
                max(h + tails[0] for h in heads),
                max(h + t for h, t in zip(heads, tails, strict=True)),
            )
            best = max(best, sum(self.duration[i] for i in mine) + extra)
        return best + self.costs.tick * self._fewest_ticks()

    def _excess(self, d: Worker, members: list[int], mine: list[int], barred: int, backward: bool):
        """The least excess over worker d's share of the ticks before the first
        (backward) or after the last (forward) of `members`: d runs only its ops
        outside `barred` there."""
        cap = self._cap([i for i in mine if not barred >> i & 1])
        links = self.preds if backward else self.succs
        walk = self.order if backward else list(reversed(self.order))
        chain = [0.0] * len(self.nodes)  # the heaviest excess of a chain that ends (starts) at i
        for i in walk:
            for j, message in links[i]:
                # Only a message puts j in a tick of its own in the chain; d's own op
                # is in d's share already.
                own = self.nodes[j][0] == d or not message
                gain = 0.0 if own else max(0.0, self.duration[j] - cap)
                chain[i] = max(chain[i], chain[j] + gain)
        return min(chain[i] for i in members)

    def _cap(self, ops: list[int]) -> float:
        """The most one tick of a worker can hold of `ops` (ir/ticks.py's rule: one F,
        one B and W_PER_TICK W's, or one F and one BW) and its OPTs."""
        most = {kind: [0.0] for kind in (Kind.F, Kind.B, Kind.W, Kind.BW)}
        opts = 0.0
        for i in ops:
            kind = self.nodes[i][1].kind
            if kind is Kind.OPT:
                opts += self.duration[i]
            else:
                most[kind].append(self.duration[i])
        f, b, bw = (max(most[k]) for k in (Kind.F, Kind.B, Kind.BW))
        w = sum(sorted(most[Kind.W], reverse=True)[:W_PER_TICK])
        return max(f + b + w, f + bw) + opts

    def _fewest_ticks(self) -> int:
        """Ticks any table needs: the longest chain of messages, and the most ops a
        worker runs in one lane."""
        depth = [1] * len(self.nodes)
        for i in self.order:
            for p, message in self.preds[i]:
                depth[i] = max(depth[i], depth[p] + message)
        per_lane: dict = {}  # (worker, lane) -> how many ticks its ops fill at least
        for w, op in self.nodes:
            if op.kind is Kind.OPT:
                continue  # a worker's OPTs share the tick that ends its gradients
            for lane in {Kind.BW: (Kind.B, Kind.W)}.get(op.kind, (op.kind,)):
                share = 1 / W_PER_TICK if op.kind is Kind.W else 1
                per_lane[(w, lane)] = per_lane.get((w, lane), 0) + share
        return max([*depth, *(math.ceil(n - 1e-9) for n in per_lane.values())], default=0)
