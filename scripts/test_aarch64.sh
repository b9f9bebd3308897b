#!/usr/bin/env bash
# Cross-compiles lily-model's tests for 64-bit Arm Linux and runs the CPU backend's tests under qemu-user, so that
# the Arm code (NEON with the dot-product instructions) is built and checked on an x86 machine: the CPU backend's
# unit tests (each on every SIMD path the emulated CPU has), then the golden tests against transformers and decode
# against prefill once per SIMD path, NEON and the portable code.
#
# Needs the Rust target (`rustup target add aarch64-unknown-linux-gnu`), the cross C compiler and linker
# aarch64-linux-gnu-gcc with its sysroot in /usr/aarch64-linux-gnu, and qemu-aarch64 (Debian and Ubuntu packages:
# gcc-aarch64-linux-gnu, qemu-user). With `--if-available` a machine without them skips the check with one line
# saying so, except under CI=true, where a missing tool is an error.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu

missing=()
libdir=$(rustc --print target-libdir --target "$target" 2>/dev/null || true)
compgen -G "$libdir/libstd-*.rlib" >/dev/null || missing+=("Rust target $target")
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(aarch64-linux-gnu-gcc)
[ -d "$sysroot/lib" ] || missing+=("$sysroot")
command -v qemu-aarch64 >/dev/null || missing+=(qemu-aarch64)
if [ ${#missing[@]} -gt 0 ]; then
  what="missing $(IFS=,; echo "${missing[*]}" | sed 's/,/, /g') (see scripts/test_aarch64.sh)"
  if [ "${1:-}" = --if-available ] && [ "${CI:-}" != true ]; then
    echo "aarch64 check skipped: $what"
    exit 0
  fi
  echo "aarch64 check cannot run: $what" >&2
  exit 1
fi

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L $sysroot"
# The test binaries' child processes would need the kernel to run Arm binaries; the SIMD path is forced per run
# instead (golden_tests_pass_on_every_simd_path only spawns children when no path is forced).
cargo_test=(cargo test --target "$target" -p lily-model)

start=$SECONDS
"${cargo_test[@]}" --lib --test golden --no-run
echo "aarch64: built in $((SECONDS - start)) s"

start=$SECONDS
"${cargo_test[@]}" --lib cpu::
# The whole golden files would take many minutes under qemu: on each path the short prompts of the default model and
# the first 20 tokens of their greedy continuations; on NEON also decode against prefill across the DeltaNet chunk
# boundary. the_simd_path_is_the_one_asked_for fails if the emulated CPU cannot run the path asked for.
for path in neon scalar; do
  echo "aarch64: golden tests on the $path path"
  LILY_CPU_SIMD=$path LILY_GOLDEN_MAX_TOKENS=20 "${cargo_test[@]}" --test golden -- --exact \
    the_simd_path_is_the_one_asked_for default_model_matches_transformers
done
LILY_CPU_SIMD=neon LILY_GOLDEN_MAX_TOKENS=65 "${cargo_test[@]}" --test golden -- --exact decode_continues_prefill_exactly
echo "aarch64: tests ran in $((SECONDS - start)) s under qemu"
