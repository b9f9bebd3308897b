#!/usr/bin/env bash
# Runs lily's whole test suite on any machine (no GPU needed): installs the Python test tools into a virtual
# environment, runs the Rust tests (CPU backend vs transformers golden data, loader, chat, server), the NVRTC
# compile check of every CUDA kernel, and the OpenAI-client tests against a real `lily serve`.
set -euo pipefail
cd "$(dirname "$0")/.."

# The Python test tools (and NVRTC 13.0 for the kernel compile check) go into a virtual environment under target/,
# never into the system's Python; scripts/python_env.sh also puts NVRTC's library directory on LD_LIBRARY_PATH and
# nvdisasm (for the test that reads the attention kernels' machine code) on PATH.
source scripts/python_env.sh

# Formatting and lints are part of the suite: either failing fails CI.
cargo fmt --all --check
cargo clippy --workspace --all-targets --release -- -D warnings

# Also builds target/release/lily, which the integration tests and the Python tests run.
cargo test --workspace --release

if [ -x tests/python/run.sh ]; then
  tests/python/run.sh target/release/lily
fi

# The CPU backend's Arm (NEON) code, cross-compiled and run under qemu: skipped with a note where the cross tools are
# missing, except under CI=true (scripts/test_aarch64.sh lists what it needs).
bash scripts/test_aarch64.sh --if-available
