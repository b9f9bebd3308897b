#!/usr/bin/env bash
# On a GPU host: a kernel variant, given as kernel constants (LILY_KERNEL_DEFINES, e.g. "MOE_DOWN_RS=0"), against
# the default kernels. First the variant's selftest against the CPU twins (the tiny config, then with --full-shape
# the real widths), then the synthetic full-shape benchmark of the default kernels and of the variant, one after the
# other in the same run, so that both sets of figures come from the same GPU.
# Usage: bench/ab_defines.sh "DEFINES" [OUTPUT_DIR]
#   LILY=path/to/lily (default target/release/lily), SEED (default 5), BENCH_ARGS (default the prefill and decode
#   rows of issue 18: -p 16,64,256,4096 -d 0,32768 -n 128 -r 2), SKIP_FULL_SHAPE=1 to skip the full-shape selftest.
set -uo pipefail
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: bench/ab_defines.sh \"NAME=VALUE ...\" [OUTPUT_DIR]" >&2
  exit 2
fi
defines=$1
out="${2:-/tmp/lily-ab}"
mkdir -p "$out"
LILY=${LILY:-target/release/lily}
seed=${SEED:-5}
bench_args=${BENCH_ARGS:--p 16,64,256,4096 -d 0,32768 -n 128 -r 2}
nvidia-smi -L
status=0
echo "== selftest, $defines"
LILY_KERNEL_DEFINES="$defines" timeout 900 "$LILY" selftest --seed "$seed" >"$out/selftest.log" 2>&1 || status=1
tail -5 "$out/selftest.log"
if [ -z "${SKIP_FULL_SHAPE:-}" ]; then
  echo "== selftest --full-shape, $defines"
  LILY_KERNEL_DEFINES="$defines" timeout 1200 "$LILY" selftest --full-shape --seed "$seed" >"$out/selftest-full.log" 2>&1 ||
    status=1
  tail -5 "$out/selftest-full.log"
fi
echo "== bench, default kernels"
# shellcheck disable=SC2086 # the arguments are words
timeout 900 "$LILY" bench --synthetic full $bench_args 2>&1 | tee "$out/bench-default.log"
echo "== bench, $defines"
# shellcheck disable=SC2086
LILY_KERNEL_DEFINES="$defines" timeout 900 "$LILY" bench --synthetic full $bench_args 2>&1 | tee "$out/bench-variant.log"
exit $status
