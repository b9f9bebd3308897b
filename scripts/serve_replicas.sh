#!/usr/bin/env bash
# Starts N `lily serve` replicas on this host (one per GPU) and vllm-router in front of them, so that clients see
# one OpenAI-compatible server and every turn of a conversation reaches the replica that holds its prefix cache.
# Stops everything when it is stopped (Ctrl-C, SIGTERM) or when any of them exits.
#
#   scripts/serve_replicas.sh [options] [-- lily serve options...]
#
# -n, --replicas N     replicas to start (default: one per GPU that nvidia-smi lists, else 2). On a GPU host replica
#                      i runs with CUDA_VISIBLE_DEVICES set to the i-th GPU (the i-th entry of CUDA_VISIBLE_DEVICES
#                      when it is set); with `--device cpu` among the lily options no GPU is assigned.
# --host HOST          address the router listens on (default 127.0.0.1; 0.0.0.0 for every interface).
# --port PORT          the router's port (default 8000).
# --replica-port PORT  replica i listens on 127.0.0.1:PORT+i (default 8100).
# --policy POLICY      vllm-router's routing policy (default sticky_least_loaded, see below).
# --metrics-port PORT  the router's own Prometheus port, on 127.0.0.1 (default 29000).
# --log-dir DIR        where replica-I.log and router.log go (default: a new directory under /tmp).
# --lily PATH          the lily binary (default: $LILY_BIN, else this checkout's target/release/lily, else lily on
#                      PATH).
# --router PATH        the vllm-router binary (default: $VLLM_ROUTER, else vllm-router on PATH; install it with
#                      `pip install vllm-router==0.1.17`).
# --ready-timeout S    seconds the replicas may take to load the model (default 1800).
#
# Everything after `--` goes to every `lily serve` (for example --model DIR --max-seqs 64 --api-key KEY); the
# launcher sets --host and --port itself. With --api-key the router passes each client's Authorization header on.
#
# Routing: with the default policy, sticky_least_loaded, a client names its conversation in an `X-Session-ID`
# header (the same value on every turn). The router sends a new conversation to the replica holding the fewest
# conversations and every later turn to that same replica, where the previous turn's state is cached; it forgets a
# conversation idle for 2 hours (VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S). Requests that name no conversation are
# balanced but not kept anywhere. Without X-Session-ID the router takes another identifying header, such as
# X-Request-ID, as the conversation's name, so a client that sends a new X-Request-ID with every request should
# send X-Session-ID too. `--policy consistent_hash` maps the header's value to a replica by hashing instead (no
# state in the router, but no regard for load); `--policy cache_aware` needs no header and matches each prompt's
# text against the prompts every replica was sent before.
#
# Responses (`/v1/responses`): each replica keeps the responses it answered, so a client that continues one
# (`previous_response_id`) or reads one back must reach the same replica: send X-Session-ID with every request of
# the conversation. vllm-router 0.1.17 does not pass the client's Authorization header on for `/v1/responses`, so
# with --api-key on the replicas the router's Responses requests are refused (401); chat and completions are not.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

replicas="" host=127.0.0.1 port=8000 replica_port=8100 policy=sticky_least_loaded metrics_port=29000
log_dir="" lily="${LILY_BIN:-}" router="${VLLM_ROUTER:-}" ready_timeout=1800
while [ $# -gt 0 ]; do
  case "$1" in
    -n|--replicas) replicas=$2; shift 2 ;;
    --host) host=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --replica-port) replica_port=$2; shift 2 ;;
    --policy) policy=$2; shift 2 ;;
    --metrics-port) metrics_port=$2; shift 2 ;;
    --log-dir) log_dir=$2; shift 2 ;;
    --lily) lily=$2; shift 2 ;;
    --router) router=$2; shift 2 ;;
    --ready-timeout) ready_timeout=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0"; exit 0 ;;
    *) echo "serve_replicas.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
lily_args=("$@")

if [ -z "$lily" ]; then
  if [ -x "$root/target/release/lily" ]; then lily=$root/target/release/lily; else lily=$(command -v lily || true); fi
fi
if [ -z "$lily" ] || [ ! -x "$lily" ]; then
  echo "serve_replicas.sh: no lily binary (cargo build --release, or --lily PATH)" >&2
  exit 2
fi
if [ -z "$router" ]; then router=$(command -v vllm-router || true); fi
if [ -z "$router" ] || [ ! -x "$router" ]; then
  echo "serve_replicas.sh: no vllm-router (pip install vllm-router==0.1.17, or --router PATH)" >&2
  exit 2
fi

# The GPUs replicas are pinned to: CUDA_VISIBLE_DEVICES's entries when it is set, else every GPU nvidia-smi lists;
# none when the replicas are told to run on the CPU.
gpus=()
cpu_only=0
for ((i = 0; i < ${#lily_args[@]}; i++)); do
  case "${lily_args[i]}" in
    --device=cpu) cpu_only=1 ;;
    --device) [ "${lily_args[i + 1]:-}" = cpu ] && cpu_only=1 ;;
  esac
done
if [ "$cpu_only" = 0 ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
  elif command -v nvidia-smi >/dev/null; then
    mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)
  fi
fi
if [ -z "$replicas" ]; then
  replicas=${#gpus[@]}
  [ "$replicas" -ge 1 ] || replicas=2
fi
[[ "$replicas" =~ ^[1-9][0-9]*$ ]] || { echo "serve_replicas.sh: --replicas must be a positive number" >&2; exit 2; }
if [ ${#gpus[@]} -gt 0 ] && [ "$replicas" -gt ${#gpus[@]} ]; then
  echo "serve_replicas.sh: $replicas replicas but ${#gpus[@]} GPUs (${gpus[*]}): one replica per GPU" >&2
  exit 2
fi

if [ -z "$log_dir" ]; then log_dir=$(mktemp -d -t lily-replicas.XXXXXX); fi
mkdir -p "$log_dir" || exit 1

pids=()
names=()
stopping=0
# Stops the router first (no new requests), then the replicas, which finish their running requests within their
# --shutdown-timeout; whatever is still running a minute later is killed.
stop_all() {
  [ "$stopping" = 1 ] && return
  stopping=1
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM "${pids[i]}" 2>/dev/null
  done
  for _ in $(seq 1 600); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for ((i = 0; i < ${#pids[@]}; i++)); do
    if kill -0 "${pids[i]}" 2>/dev/null; then
      echo "serve_replicas.sh: ${names[i]} did not stop within 60 s; killing it" >&2
      kill -KILL "${pids[i]}" 2>/dev/null
    fi
  done
  wait 2>/dev/null
}
trap 'stop_all' EXIT
trap 'exit 0' INT TERM

# Waits until GET URL answers 200, while process PID lives; at most TIMEOUT seconds.
wait_ready() {
  local url=$1 pid=$2 timeout=$3 start=$SECONDS
  while [ $((SECONDS - start)) -lt "$timeout" ]; do
    kill -0 "$pid" 2>/dev/null || return 1
    python3 -c 'import sys, urllib.request; sys.exit(urllib.request.urlopen(sys.argv[1], timeout=2).status != 200)' \
      "$url" 2>/dev/null && return 0
    sleep 0.5
  done
  return 1
}

worker_urls=()
for ((i = 0; i < replicas; i++)); do
  p=$((replica_port + i))
  log="$log_dir/replica-$i.log"
  if [ ${#gpus[@]} -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=${gpus[i]} "$lily" serve --host 127.0.0.1 --port "$p" "${lily_args[@]}" >"$log" 2>&1 &
  else
    "$lily" serve --host 127.0.0.1 --port "$p" "${lily_args[@]}" >"$log" 2>&1 &
  fi
  pids+=($!)
  names+=("replica $i")
  worker_urls+=("http://127.0.0.1:$p")
  echo "replica $i: http://127.0.0.1:$p${gpus[i]:+ on GPU ${gpus[i]}} (pid $!, log $log)"
done
for ((i = 0; i < replicas; i++)); do
  if ! wait_ready "${worker_urls[i]}/health" "${pids[i]}" "$ready_timeout"; then
    echo "serve_replicas.sh: replica $i did not become ready; the end of its log:" >&2
    tail -20 "$log_dir/replica-$i.log" >&2
    exit 1
  fi
done

"$router" --host "$host" --port "$port" --worker-urls "${worker_urls[@]}" --policy "$policy" \
  --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port" >"$log_dir/router.log" 2>&1 &
pids+=($!)
names+=("the router")
router_url="http://$host:$port"
[ "$host" = 0.0.0.0 ] && router_url="http://127.0.0.1:$port"
if ! wait_ready "$router_url/health" "$!" 120; then
  echo "serve_replicas.sh: vllm-router did not become ready; the end of its log:" >&2
  tail -20 "$log_dir/router.log" >&2
  exit 1
fi
echo "router: http://$host:$port, policy $policy, metrics on 127.0.0.1:$metrics_port" \
  "(pid ${pids[-1]}, log $log_dir/router.log)"
echo "ready: $replicas replicas behind http://$host:$port/v1"

# Runs until stopped, or until one of the processes exits, which stops the others.
wait -n
for ((i = 0; i < ${#pids[@]}; i++)); do
  if ! kill -0 "${pids[i]}" 2>/dev/null; then
    echo "serve_replicas.sh: ${names[i]} exited; stopping the others (logs in $log_dir)" >&2
    break
  fi
done
exit 1
