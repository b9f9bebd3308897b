#!/usr/bin/env bash
# One device call: selftest, bench at the target depths with per-kernel profile. Logs under $OUT.
set -uo pipefail
export LILY_CACHE=/tmp/lily-cache
NVRTC_PIP="$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${NVRTC_PIP}:${LD_LIBRARY_PATH:-}"
LILY=${LILY:-.gpu/lily}
chmod +x "$LILY"
nvidia-smi -L
echo "== selftest"
timeout ${SELFTEST_TIMEOUT:-300} "$LILY" selftest ${SELFTEST_ARGS:-} 2>&1 | tee "$OUT/selftest.log"
echo "== bench"
timeout ${BENCH_TIMEOUT:-200} "$LILY" bench --synthetic full -d ${DEPTHS:-0,4096,32768,131072} -n ${NGEN:-128} -r ${REPS:-3} ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "== generate (default model, --device cuda; greedy, then sampled)"
timeout 60 "$LILY" generate --device cuda --max-tokens 48 2>&1 | tee "$OUT/generate.log"
timeout 60 "$LILY" generate --device cuda --max-tokens 48 --temperature 0.8 --top-k 20 --top-p 0.95 --seed 7 2>&1 | tee -a "$OUT/generate.log"
