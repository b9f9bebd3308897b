#!/usr/bin/env bash
# On a GPU host: two builds of lily against each other (a change's binary against the one before it). First the new
# build's selftest against the CPU twins (the tiny config, then with --full-shape the real widths), then the
# synthetic full-shape benchmark of both, alternating old, new, old, new, so that slow drift of the card's clocks
# shows as a difference between the two rounds rather than between the builds.
# Usage: bench/ab_binaries.sh OLD_LILY NEW_LILY [OUTPUT_DIR]
#   SEED (default 5), BENCH_ARGS (default the prefill and decode rows of issue 18: -p 16,64,256,4096 -d 0,32768
#   -n 128 -r 2), SKIP_FULL_SHAPE=1 to skip the full-shape selftest, LILY_KERNEL_DEFINES as for any run (both builds).
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bench/ab_binaries.sh OLD_LILY NEW_LILY [OUTPUT_DIR]" >&2
  exit 2
fi
old=$1
new=$2
out="${3:-/tmp/lily-ab-binaries}"
mkdir -p "$out"
seed=${SEED:-5}
bench_args=${BENCH_ARGS:--p 16,64,256,4096 -d 0,32768 -n 128 -r 2}
for bin in "$old" "$new"; do
  [ -x "$bin" ] || { echo "not an executable: $bin" >&2; exit 2; }
done
nvidia-smi -L
status=0
echo "== selftest, new build"
timeout 900 "$new" selftest --seed "$seed" >"$out/selftest.log" 2>&1 || status=1
tail -2 "$out/selftest.log"
if [ -z "${SKIP_FULL_SHAPE:-}" ]; then
  echo "== selftest --full-shape, new build"
  timeout 1200 "$new" selftest --full-shape --seed "$seed" >"$out/selftest-full.log" 2>&1 || status=1
  tail -2 "$out/selftest-full.log"
fi
for round in 1 2; do
  for side in old new; do
    bin=$old
    [ "$side" = new ] && bin=$new
    echo "== bench, $side build, round $round"
    # shellcheck disable=SC2086 # the arguments are words
    timeout 900 "$bin" bench --synthetic full $bench_args 2>&1 | tee "$out/bench-$side-$round.log"
  done
done
exit $status
