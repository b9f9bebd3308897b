#!/usr/bin/env bash
# On a GPU host with Nsight Compute: why the 4,096-token prefill's heaviest kernels take the time they do. Runs
# `lily bench --synthetic full -p 4096 -n 0 -r 1` under `ncu`, profiling a few launches of the kernels named (after
# skipping the first few), and prints each launch's duration, throughput, occupancy and warp stall reasons; the
# whole report goes to OUTPUT_DIR/ncu.txt.
# Usage: bench/ncu_prefill.sh [OUTPUT_DIR]
#   LILY=path/to/lily (default target/release/lily), KERNELS (a regular expression of kernel names; default the
#   experts' products and the DeltaNet state pass), SKIP and COUNT (launches of any of them skipped, then
#   profiled; default 3 and 3: one layer's), LILY_KERNEL_DEFINES as for any run.
set -uo pipefail
out="${1:-/tmp/lily-ncu}"
mkdir -p "$out"
LILY=${LILY:-target/release/lily}
kernels=${KERNELS:-deltanet_prefill_state|moe_gate_up_rs|moe_down_rs}
command -v ncu >/dev/null || { echo "ncu (Nsight Compute) is required" >&2; exit 2; }
nvidia-smi -L
# --clock-control none: the card's own clocks, as the benchmark sees them.
ncu --clock-control none -k "regex:^($kernels)\$" -s "${SKIP:-3}" -c "${COUNT:-3}" \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --section Occupancy "$LILY" bench --synthetic full -p 4096 -d 0 -n 0 -r 1 >"$out/ncu.txt" 2>&1
status=$?
grep -E "^  [a-z_0-9]+\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Stall|Warp Cycles Per Issued|No Eligible|Achieved Occupancy" \
  "$out/ncu.txt"
exit $status
