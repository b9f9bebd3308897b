#!/usr/bin/env bash
# Checks `lily serve` on a GPU host: starts the server on the GPU, runs the OpenAI-client tests (tests/python)
# against it, measures the streamed decode speed of one long request, and prints it beside `lily bench`'s decode
# (tg) speed at the same context depth.
#
#   scripts/gpu_serve_check.sh [--model DIR] [--device cuda|cpu|auto] [--lily PATH] [--depth N] [--tokens N]
#                              [--no-tests] [--no-bench]
#
# --model DIR   a model directory, or `bundled` for the bundled lily-tiny-shakespeare; default: a full-shape
#               synthetic checkpoint (random weights, 19.5 GB) made once with `lily synth --shape full` in
#               target/synth-full.
# --device      passed to `lily serve` (default cuda). With --device cpu (and, say, --model bundled) the script
#               runs anywhere, without `lily bench`.
# --lily PATH   the lily binary (default target/release/lily, built with cargo when missing).
# --depth N     prompt tokens of the long request, and the depth of `lily bench` (default 512).
# --tokens N    tokens the long request generates (default 1000, end-of-sequence ignored).
#
# The Python tests need `openai` and `pytest`: taken from python3 when it has them, else from the virtual
# environment scripts/python_env.sh makes. Exits non-zero when the tests fail, the server does not start or stop
# cleanly, or the streamed decode is below 95% of `lily bench`'s.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

model="" device=cuda lily=target/release/lily depth=512 tokens=1000 run_tests=1 run_bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --lily) lily=$2; shift 2 ;;
    --depth) depth=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --no-tests) run_tests=0; shift ;;
    --no-bench) run_bench=0; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_serve_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$depth" -ge 1 ] && [ "$tokens" -ge 2 ] || { echo "--depth must be >= 1 and --tokens >= 2" >&2; exit 2; }

if [ ! -x "$lily" ]; then
  echo "== building $lily" >&2
  cargo build --release || exit 1
fi
lily=$(realpath "$lily")

if python3 -c 'import openai, pytest' 2>/dev/null; then
  python=python3
else
  # shellcheck source=scripts/python_env.sh
  source scripts/python_env.sh || { echo "gpu_serve_check.sh: no Python with openai and pytest" >&2; exit 1; }
  python=python
fi

if [ -z "$model" ]; then
  model=target/synth-full
  if [ ! -f "$model/config.json" ]; then
    echo "== writing a full-shape synthetic checkpoint to $model" >&2
    "$lily" synth --shape full --out "$model" || exit 1
  fi
fi
if [ "$model" = bundled ]; then
  model_args=()
else
  [ -f "$model/config.json" ] || { echo "gpu_serve_check.sh: $model has no config.json" >&2; exit 2; }
  model_args=(--model "$(realpath "$model")")
fi

key="lily-gpu-check-key"
model_id="lily-check"
context=$((depth + tokens + 64))
[ "$context" -lt 4096 ] && context=4096
log=$(mktemp)
echo "== lily serve ${model_args[*]} --device $device --context $context (log: $log)" >&2
LILY_LOG=${LILY_LOG:-info} "$lily" serve "${model_args[@]}" --device "$device" --port 0 --api-key "$key" \
  --served-model-name "$model_id" --context "$context" --max-queue 32 >"$log" 2>&1 &
pid=$!
trap 'kill -KILL "$pid" 2>/dev/null' EXIT

stop_server() {
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 600); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "gpu_serve_check.sh: lily serve did not exit within 60 s of SIGTERM" >&2
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    return 1
  fi
  wait "$pid"
}

# The port is bound at once; /health answers 200 once the weights are loaded (minutes for 19.5 GB).
base=""
for _ in $(seq 1 600); do
  base=$(grep -o 'listening on http://[0-9.:]*' "$log" | head -1 | sed 's/listening on //')
  [ -n "$base" ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
health=""
if [ -n "$base" ]; then
  for _ in $(seq 1 3600); do
    health=$("$python" -c "import sys, urllib.request; r = urllib.request.urlopen('$base/health', timeout=2); print(r.read().decode())" 2>/dev/null) && break
    health=""
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
fi
if [ -z "$health" ]; then
  echo "gpu_serve_check.sh: lily serve did not become ready; its log:" >&2
  cat "$log" >&2
  exit 1
fi
echo "== ready: /health says $health" >&2
grep 'ready on' "$log" >&2
status=0
if [ "$device" = cuda ] && ! grep -q '"device":"cuda' <<<"$health"; then
  echo "gpu_serve_check.sh: --device cuda but /health reports another device" >&2
  status=1
fi

if [ "$run_tests" = 1 ]; then
  echo "== OpenAI-client tests (tests/python)" >&2
  PYTHONDONTWRITEBYTECODE=1 LILY_BASE_URL="$base" LILY_API_KEY="$key" LILY_MODEL_ID="$model_id" \
    "$python" -m pytest -q -p no:cacheprovider tests/python || status=1
fi

echo "== one streamed request: $depth prompt tokens, $tokens tokens out (greedy, end-of-sequence ignored)" >&2
serve_rate=$(LILY_BASE_URL="$base" LILY_API_KEY="$key" "$python" - "$model_id" "$depth" "$tokens" <<'PY'
import sys, time, openai
model, depth, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import os
client = openai.OpenAI(base_url=os.environ["LILY_BASE_URL"] + "/v1", api_key=os.environ["LILY_API_KEY"],
                       max_retries=0, timeout=600)
# Token ids as the prompt give an exact depth; the ids are ordinary vocabulary entries.
prompt = [1000 + (i * 7919) % 100000 for i in range(depth)]
stream = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
first = last = None
completion_tokens = None
for chunk in stream:
    now = time.perf_counter()
    if chunk.choices:
        if first is None:
            first = now
        last = now
    if chunk.usage is not None:
        completion_tokens = chunk.usage.completion_tokens
if completion_tokens != tokens or first is None or last <= first:
    sys.exit(f"unexpected stream: {completion_tokens} tokens (wanted {tokens})")
# The first chunk comes with the first token (or a few tokens later when a token's text is incomplete UTF-8);
# the last comes with the end of the last token: tokens - 1 decode steps lie between them.
print(f"{(tokens - 1) / (last - first):.1f}")
PY
) || { echo "gpu_serve_check.sh: the long request failed" >&2; status=1; serve_rate=""; }

stop_server || status=1
trap - EXIT
grep -iE 'panic|error' "$log" >&2 && echo "(the lines above are from the server's log: $log)" >&2

echo
echo "lily serve --device $device: streamed decode ${serve_rate:-?} tok/s (depth $depth, $tokens tokens)"
if [ "$run_bench" = 1 ] && [ "$device" != cpu ] && [ -n "$serve_rate" ]; then
  json=$(mktemp)
  "$lily" bench "${model_args[@]}" -d "$depth" -n "$tokens" -r 3 --json "$json" >&2 || status=1
  bench_rate=$("$python" -c "import json, sys; rows = json.load(open('$json'))['results']; print(next(r['tokens_per_s_mean'] for r in rows if r['test'].startswith('tg')))" 2>/dev/null)
  rm -f "$json"
  if [ -n "$bench_rate" ]; then
    echo "lily bench tg$tokens at depth $depth:      ${bench_rate} tok/s"
    verdict=$("$python" -c "s, b = $serve_rate, $bench_rate; print(f'{100 * s / b:.1f}% of bench: ' + ('ok' if s >= 0.95 * b else 'BELOW 95%'))")
    echo "server / bench: $verdict"
    grep -q 'BELOW' <<<"$verdict" && status=1
  else
    echo "lily bench: no tg result"
    status=1
  fi
fi
[ "$status" = 0 ] && rm -f "$log"
exit "$status"
