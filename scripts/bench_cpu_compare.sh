#!/usr/bin/env bash
# Compares the CPU speed of two or more lily binaries on one host: runs `lily bench --device cpu` with each binary in
# turn, round after round (so that a change in the host's load during the call falls on every binary alike), prints
# one line per run (binary, round, prompt and decode tok/s) and at the end the median of each binary over the rounds.
#
# Usage:
#   scripts/bench_cpu_compare.sh [options] BINARY BINARY [BINARY...]
#
# Options (defaults in brackets):
#   --synthetic SHAPE  weights generated in memory at this shape (`tiny` or `full`) [full]
#   --model DIR        a model directory instead of --synthetic (`bundled`: lily's bundled small model)
#   --rounds R         rounds; each round runs every binary once [3]
#   --threads T        CPU threads (`-t`) [one per core]
#   --prompt P         prompt tokens of the prompt test (`-p`) [128]
#   --gen N            generated tokens of the decode test (`-n`) [16]
#   --reps K           timed repetitions inside one run (`-r`), after one warm-up [2]
#   --layers L         with --synthetic: only the first L layers [all]
#
# A BINARY may be a command with arguments or environment settings in one quoted word, for example
# 'env LILY_CPU_SPIN_US=0 ./lily' to time the same binary with another setting.
#
# Example (16-core host, two builds of lily):
#   scripts/bench_cpu_compare.sh --synthetic full --threads 16 --rounds 3 old/lily new/lily
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit "${1:-0}"
}

synthetic=full
model=""
rounds=3
threads=$(nproc)
prompt=128
gen=16
reps=2
layers=""
binaries=()
while [ $# -gt 0 ]; do
    case "$1" in
        --synthetic) synthetic="$2"; model=""; shift 2 ;;
        --model) model="$2"; synthetic=""; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --prompt) prompt="$2"; shift 2 ;;
        --gen) gen="$2"; shift 2 ;;
        --reps) reps="$2"; shift 2 ;;
        --layers) layers="$2"; shift 2 ;;
        -h|--help) usage 0 ;;
        --) shift; binaries+=("$@"); break ;;
        -*) echo "unknown option $1" >&2; usage 2 ;;
        *) binaries+=("$1"); shift ;;
    esac
done
if [ "${#binaries[@]}" -lt 2 ]; then
    echo "give at least two binaries" >&2
    usage 2
fi

source_args=()
if [ "$model" = bundled ]; then
    source_args=()
elif [ -n "$model" ]; then
    source_args=(--model "$model")
else
    source_args=(--synthetic "$synthetic")
    if [ -n "$layers" ]; then
        source_args+=(--layers "$layers")
    fi
fi

source_words=""
if [ "${#source_args[@]}" -gt 0 ]; then
    source_words=$(printf '%q ' "${source_args[@]}")
fi

exec python3 - "$rounds" "$threads" "$prompt" "$gen" "$reps" "$source_words" "${binaries[@]}" <<'EOF'
import shlex
import statistics
import subprocess
import sys

rounds, threads, prompt, gen, reps = (int(v) for v in sys.argv[1:6])
source = shlex.split(sys.argv[6])
binaries = sys.argv[7:]
bench = ["bench", "--device", "cpu", *source, "-p", str(prompt), "-n", str(gen), "-r", str(reps), "-t", str(threads)]
pp_name, tg_name = f"pp{prompt}", f"tg{gen}"
print(f"# lily {' '.join(bench)}; {rounds} rounds over {len(binaries)} binaries", flush=True)


def run(binary):
    """One bench run: {test name: mean tok/s} from the bench's table."""
    command = shlex.split(binary) + bench
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{binary} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    figures = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # | model | device | threads | test | depth | t/s (mean ± std) | bytes/token | GB/s |
        if len(cells) >= 6 and cells[3] in (pp_name, tg_name):
            try:
                figures[cells[3]] = float(cells[5].split()[0])
            except ValueError:
                pass
    return figures


def show(value):
    return f"{value:10.2f}" if value is not None else f"{'-':>10}"


samples = {b: {pp_name: [], tg_name: []} for b in binaries}
width = max(20, *(len(b) for b in binaries))
print(f"{'binary':<{width}} {'round':>5} {pp_name + ' tok/s':>14} {tg_name + ' tok/s':>14}")
for r in range(1, rounds + 1):
    for binary in binaries:
        figures = run(binary)
        for name in (pp_name, tg_name):
            if name in figures:
                samples[binary][name].append(figures[name])
        print(f"{binary:<{width}} {r:>5} {show(figures.get(pp_name)):>14} {show(figures.get(tg_name)):>14}", flush=True)

print(f"\n{'median over rounds':<{width}} {'runs':>5} {pp_name + ' tok/s':>14} {tg_name + ' tok/s':>14}")
for binary in binaries:
    med = {n: statistics.median(v) if v else None for n, v in samples[binary].items()}
    runs = len(samples[binary][pp_name] or samples[binary][tg_name])
    print(f"{binary:<{width}} {runs:>5} {show(med[pp_name]):>14} {show(med[tg_name]):>14}")
EOF
