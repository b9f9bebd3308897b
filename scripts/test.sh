#!/usr/bin/env bash
# Runs lily's whole test suite on any machine (no GPU needed): installs the Python test tools, runs the Rust
# tests (CPU backend vs transformers golden data, loader, chat, server), the NVRTC compile check of every CUDA
# kernel, and the OpenAI-client tests against a real `lily serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet --disable-pip-version-check -r scripts/test-requirements.txt
# CUDA kernels are compiled with NVRTC 13.0 (a newer NVRTC emits PTX a 13.0 driver cannot load).
NVRTC_LIB="$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)"
if [ -n "$NVRTC_LIB" ] && [ -d "$NVRTC_LIB" ]; then
  export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# Formatting and lints are part of the suite: either failing fails CI.
cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings

# Also builds target/release/lily, which the integration tests and the Python tests run.
cargo test --workspace --release

if [ -x tests/python/run.sh ]; then
  tests/python/run.sh target/release/lily
fi
