# Sourced by lily's scripts: makes (once) and activates a Python virtual environment with the test tools
# (scripts/test-requirements.txt), so nothing is installed into the system's Python, and puts NVRTC 13.0's library
# directory on LD_LIBRARY_PATH where the environment has it.
#
#   source scripts/python_env.sh      # from the repository root
#
# The environment lives in target/python-venv (LILY_VENV overrides); it is rebuilt when the requirements change.

lily_venv="${LILY_VENV:-target/python-venv}"
lily_requirements="scripts/test-requirements.txt"
if [ ! -x "$lily_venv/bin/python" ]; then
  python3 -m venv "$lily_venv" || {
    echo "python_env.sh: python3 -m venv failed (on Debian/Ubuntu: apt install python3-venv)" >&2
    return 1
  }
fi
if ! cmp -s "$lily_requirements" "$lily_venv/.requirements"; then
  "$lily_venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$lily_requirements" || return 1
  cp "$lily_requirements" "$lily_venv/.requirements"
fi
export VIRTUAL_ENV="$(cd "$lily_venv" && pwd)"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# CUDA kernels are compiled with NVRTC 13.0 (a newer NVRTC emits PTX a 13.0 driver cannot load).
lily_nvrtc_lib="$(python -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)"
if [ -n "$lily_nvrtc_lib" ] && [ -d "$lily_nvrtc_lib" ]; then
  export LD_LIBRARY_PATH="$lily_nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # nvdisasm, for the test that reads the attention kernels' machine code.
  if [ -x "$lily_nvrtc_lib/../bin/nvdisasm" ]; then
    export PATH="$(cd "$lily_nvrtc_lib/../bin" && pwd):$PATH"
  fi
fi
unset lily_venv lily_requirements lily_nvrtc_lib
