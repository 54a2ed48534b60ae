#!/bin/bash
# The step-cost checks on one GPU, in one command (about six minutes on an H200):
# every kind of bench_models on the bf16 GPT-2 with a Perfetto trace of each program,
# the residual policies of one stage at d768 and d2048, and the non-finite check.
# Each part writes its output under OUT (default ./gpu-out), so a part cut short
# by its timeout still leaves the ones before it.
set -o pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # run SECONDS NAME ARGS...: python -m ARGS under a timeout, output to OUT/NAME.txt
    local limit=$1 name=$2
    shift 2
    timeout "$limit" python3 -m "$@" 2>&1 | grep -v "^[EW][0-9]" | tee "$OUT/$name.txt"
}
run 240 models benchmarks.bench_models --model gpt2-124m --dtype bf16 \
    --kinds 1f1b,zb-h1,zb-v,interleaved-1f1b,async-1f1b --rounds 8 --trace "$OUT/traces"
run 60 policy768 benchmarks.bench_residual_policy --d 768 --dtype bf16 --tokens 1024 --rounds 10
run 70 policy2048 benchmarks.bench_residual_policy --d 2048 --dtype bf16 --tokens 1024 --rounds 10
run 70 nonfinite benchmarks.bench_models --model gpt2-124m --dtype bf16 --kinds 1f1b \
    --skip-nonfinite both --rounds 10
run 200 llama benchmarks.bench_models --model llama --kinds 1f1b,zb-v,async-1f1b --rounds 5
