#!/usr/bin/env bash
# On a GPU host: the kernel self-test, the decode benchmark at the target depths with a per-kernel profile, each
# kernel's share of the captured step, and generation on the GPU. Usage: bench/run_gpu.sh [OUTPUT_DIR]
# (LILY=path/to/lily, default target/release/lily)
set -uo pipefail
out="${1:-bench/out}"
mkdir -p "$out"
LILY=${LILY:-target/release/lily}
nvidia-smi -L
echo "== selftest"
timeout ${SELFTEST_TIMEOUT:-300} "$LILY" selftest ${SELFTEST_ARGS:-} 2>&1 | tee "$out/selftest.log"
echo "== bench"
timeout ${BENCH_TIMEOUT:-200} "$LILY" bench --synthetic full -d ${DEPTHS:-0,4096,32768,131072} -n ${NGEN:-128} -r ${REPS:-3} ${BENCH_ARGS:-} --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
echo "== timeline (kernels compiled with a clock probe: each kernel's share of the captured decode step)"
timeout ${BENCH_TIMEOUT:-200} "$LILY" bench --synthetic full -d ${DEPTHS:-0,4096,32768,131072} -n 64 -r 1 --timeline 2>&1 | tee "$out/timeline.log"
echo "== generate (default model, --device cuda; greedy, then sampled)"
timeout 60 "$LILY" generate --device cuda --max-tokens 48 2>&1 | tee "$out/generate.log"
timeout 60 "$LILY" generate --device cuda --max-tokens 48 --temperature 0.8 --top-k 20 --top-p 0.95 --seed 7 2>&1 | tee -a "$out/generate.log"
