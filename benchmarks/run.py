"""`make bench` (`python -m benchmarks.run [name ...]`): run every benchmark and print its figures."""

import importlib
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

BENCHMARKS = [
    "bench_schedules",
    "bench_exact",
    "bench_failures",
    "bench_slow",
    "bench_lowering",
    "bench_variants",
    "bench_compile",
    "bench_memory",
    "bench_backward",
    "bench_param_layout",
    "bench_dropout",
    "bench_planner",
    "bench_lockstep",
    "bench_pack_memory",
    "bench_lane_order",
    "bench_async",
    "bench_gpu",
    "bench_bf16",
    "bench_models",
]


def main() -> None:
    only = sys.argv[1:] or BENCHMARKS
    for name in only:
        print(f"\n=== {name} ===", flush=True)
        start = time.perf_counter()
        importlib.import_module(f"benchmarks.{name}").main([])  # each benchmark's defaults
        print(f"({name}: {time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
