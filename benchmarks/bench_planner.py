"""The pipeline planner against the paper's baselines, in simulation.

Two 8-GPU nodes (150 GB/s inside a node, 100 Gb/s between nodes, 32 GB per
GPU) and the shipped V100 profiles (VGG-19, BERT-24, GNMT-16). For each model
and shape D x P, at m microbatches per replica under 1F1B, the period (ms per
iteration, the event simulator's, see pjit_pipe.planner.cost) of:

- even: the even-compute split with the row-major mapping (replica r on
  devices r*P .. r*P+P-1);
- best-partition: the best partition on the row-major mapping (partition
  only, DAPPLE-like): the partition DP, then hill climbing on the cuts;
- best-mapping: the best mapping of the even split: the proxy swap search,
  then hill climbing on the mapping;
- planner: `pjit-pipe plan` with that shape and schedule.

Then the planner free to choose D, P and the schedule (period / D compared),
and the wall time of planning GNMT-16 on the 16 devices with everything free
(target: under 10 s). Finally the fast search against the exact engine on 30
random 8-layer, 4-device instances with asymmetric links.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pjit_pipe.planner import (
    CostModel,
    Plan,
    Searcher,
    cluster,
    shipped_profile,
)
from pjit_pipe.planner.cost import peak_inflight
from pjit_pipe.planner.exhaustive import exact_plan
from pjit_pipe.planner.partition import even_cuts, positions
from pjit_pipe.planner.random_instance import random_instance

MODELS = ("vgg-19", "bert-24", "gnmt-16")
SHAPES = ((1, 16), (2, 8))
KIND = "1f1b"
BASELINE_CLIMB = 60  # simulations for each baseline's hill climb


def baselines(searcher: Searcher, D: int, P: int, m: int) -> dict[str, float | None]:
    model = searcher.model
    n = len(model.profile)
    row_major = tuple(tuple(range(r * P, (r + 1) * P)) for r in range(D))
    even = Plan.from_cuts(even_cuts(model.profile.work, P), n, row_major, KIND)
    out = {"even": model.evaluate(even)}
    # best partition on the row-major mapping
    peaks = peak_inflight(KIND, P, m)
    starts = [even]
    for weight in (0.5, 0.0):
        found = searcher.part.best(positions(model, row_major), peaks, weight)
        if found:
            starts.append(Plan.from_cuts(found[0], n, row_major, KIND))
    best = min((searcher.evaluate(p) for p in starts if model.fits(p)), key=searcher.objective)
    out["best-partition"] = searcher.climb(best, BASELINE_CLIMB, [KIND], vary="cuts")
    # best mapping of the even split
    cuts = even_cuts(model.profile.work, P)
    mapping, _ = searcher.improve_mapping(cuts, [list(r) for r in row_major], peaks, 0.5)
    starts = [even, Plan.from_cuts(cuts, n, mapping, KIND)]
    best = min((searcher.evaluate(p) for p in starts if model.fits(p)), key=searcher.objective)
    out["best-mapping"] = searcher.climb(best, BASELINE_CLIMB, [KIND], vary="mapping")
    out["planner"] = searcher.search(stages=P, replicas=D, schedule=KIND)
    return {k: model.evaluate(v.plan).period for k, v in out.items()}


def fast_vs_exact(instances: int) -> list[float]:
    gaps = []
    for seed in range(instances):
        profile, devices = random_instance(seed)
        model = CostModel(profile, devices, 4)
        fast = Searcher(model).search()
        exact, _ = exact_plan(model)
        gaps.append((fast.period / fast.plan.replicas) / (exact.period / exact.plan.replicas) - 1)
    return gaps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=16, help="per replica")
    parser.add_argument("--instances", type=int, default=30, help="random fast-vs-exact instances")
    args = parser.parse_args(argv)
    m = args.microbatches
    devices = cluster(2, 8)
    print(f"two 8-GPU nodes, 150 GB/s intra, 100 Gb/s inter, 32 GB; m={m} per replica, {KIND}")
    print(
        f"{'model':9} {'DxP':5} {'even':>9} {'best-part':>9} {'best-map':>9} {'planner':>9}"
        f"   ratios even/best-part/best-map : planner"
    )
    for name in MODELS:
        model = CostModel(shipped_profile(name), devices, m)
        searcher = Searcher(model)
        for D, P in SHAPES:
            res = baselines(searcher, D, P, m)
            fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'OOM':>9}"  # noqa: E731
            ratios = " / ".join(
                f"{res[k] / res['planner']:.2f}x" if res[k] else "OOM"
                for k in ("even", "best-partition", "best-mapping")
            )
            print(
                f"{name:9} {D}x{P:<3} {fmt(res['even'])} {fmt(res['best-partition'])} "
                f"{fmt(res['best-mapping'])} {fmt(res['planner'])}   {ratios}",
                flush=True,
            )
    print("\nplanner free to choose D, P and the schedule (period per replica's microbatches):")
    for name in MODELS:
        model = CostModel(shipped_profile(name), devices, m)
        start = time.perf_counter()
        ev = Searcher(model).search()
        took = time.perf_counter() - start
        print(
            f"{name:9} {ev.plan.replicas}x{ev.plan.num_stages} {ev.plan.schedule:6} period "
            f"{ev.period:9.1f} ms, {ev.period / ev.plan.replicas:8.1f} ms per replica-batch; "
            f"planned in {took:.1f} s",
            flush=True,
        )
    if args.instances:
        gaps = fast_vs_exact(args.instances)
        within = sum(g <= 0.01 for g in gaps)
        print(
            f"\nfast vs exact, {len(gaps)} random 8-layer/4-device instances: {within} within 1%,"
            f" median gap {np.median(gaps):.2%}, worst {max(gaps):.2%}"
        )


if __name__ == "__main__":
    main()
