#!/usr/bin/env bash
# Runs the Python client tests (the official `openai` package, pytest) against a real `lily serve`.
#
#   tests/python/run.sh PATH/TO/lily [pytest args...]
#
# Builds nothing. Needs python3 with `openai` and `pytest` (scripts/test.sh runs it in the virtual environment that
# scripts/python_env.sh makes). Starts
# `lily serve` (default model, an API key, any free port) from the repository root, waits for /health, runs
# pytest, then stops the server with SIGTERM and checks that it exits cleanly (graceful shutdown). Tests that start
# servers of their own (test_replicas.py) run the same lily binary, which they find in LILY_BIN.
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 PATH/TO/lily [pytest args...]" >&2
    exit 2
fi
lily=$(realpath "$1")
shift
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
[ -x "$lily" ] || { echo "not an executable: $lily" >&2; exit 2; }

key="lily-python-test-key"
log=$(mktemp)
cd "$root"
LILY_LOG=${LILY_LOG:-info} "$lily" serve --port 0 --api-key "$key" --context 4096 --max-queue 32 >"$log" 2>&1 &
pid=$!

stop_server() {
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        # Longer than the server's own grace period for requests in flight (--shutdown-timeout, 30 s).
        for _ in $(seq 1 450); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "run.sh: lily serve did not exit within 45 s of SIGTERM" >&2
            kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            return 1
        fi
    fi
    wait "$pid"
}
trap 'kill -KILL "$pid" 2>/dev/null' EXIT

# The server prints "listening on http://HOST:PORT" once the port is bound; /health is 200 once the model loaded.
base=""
for _ in $(seq 1 600); do
    base=$(grep -o 'listening on http://[0-9.:]*' "$log" | head -1 | sed 's/listening on //')
    [ -n "$base" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
ready=""
if [ -n "$base" ]; then
    for _ in $(seq 1 1200); do
        if python3 -c "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('$base/health', timeout=2).status == 200 else 1)" 2>/dev/null; then
            ready=1
            break
        fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
fi
if [ -z "$ready" ]; then
    echo "run.sh: lily serve did not become ready; its log:" >&2
    cat "$log" >&2
    exit 1
fi

PYTHONDONTWRITEBYTECODE=1 LILY_BASE_URL="$base" LILY_API_KEY="$key" LILY_BIN="$lily" python3 -m pytest -q -p no:cacheprovider "$here" "$@"
status=$?

if [ "$status" -ne 0 ]; then
    echo "run.sh: pytest failed; the server's log (last 50 lines):" >&2
    tail -50 "$log" >&2
fi
stop_server
server_status=$?
if [ "$server_status" -ne 0 ]; then
    echo "run.sh: lily serve exited with status $server_status after SIGTERM; its log:" >&2
    cat "$log" >&2
    [ "$status" -eq 0 ] && status=1
fi
trap - EXIT
rm -f "$log"
exit "$status"
