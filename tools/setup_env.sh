#!/usr/bin/env bash
# Create (or update) the project's virtual environment: Python 3.12, torch 2.14.1 (a working CUDA
# torch already in the venv is kept), megatron-core 0.19, the package in editable mode.
# Idempotent: a second run only checks what is installed.
#   VENV=.venv  PYTHON=/path/to/python3.12  bash tools/setup_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

is_py312() { "$@" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  if [ -n "${PYTHON:-}" ] && is_py312 "$PYTHON"; then echo "$PYTHON"; return; fi
  for candidate in python3.12 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && is_py312 "$candidate"; then command -v "$candidate"; return; fi
  done
  # pyenv: the python3.12 shim fails unless PYENV_VERSION names an installed 3.12.x.
  if command -v pyenv >/dev/null 2>&1; then
    for dir in "$(pyenv root)"/versions/3.12*; do
      [ -x "$dir/bin/python3.12" ] && is_py312 "$dir/bin/python3.12" && { echo "$dir/bin/python3.12"; return; }
    done
  fi
  for dir in /usr/local/bin /usr/bin /opt/python/3.12/bin; do
    [ -x "$dir/python3.12" ] && is_py312 "$dir/python3.12" && { echo "$dir/python3.12"; return; }
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! is_py312 "$VENV/bin/python"; then
  PY=$(find_python) || { echo "error: Python 3.12 not found (megatron-core 0.17+ needs it); set PYTHON=/path/to/python3.12" >&2; exit 2; }
  echo "setup: creating $VENV with $PY"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
# requirements.txt pins torch for CPU machines and CI. A torch already in the venv that is in the
# supported range (epas_megatron/runtime/accelerator.py: SUPPORTED_TORCH) and sees CUDA -- a GPU
# node's build for its driver -- is kept: the pin is left out and the kept version is a constraint.
# Where torch is missing or sees no CUDA (every CPU machine) the pin installs as before.
REQUIREMENTS=(-r requirements.txt)
CONSTRAINTS=()
if KEEP_TORCH=$(PYTHONPATH=. "$VENV/bin/python" -c 'import sys, torch
from epas_megatron.runtime.accelerator import torch_version_problem
sys.exit(0 if torch.cuda.is_available() and torch_version_problem(torch.__version__) is None else 1)
' 2>/dev/null && "$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  KEEP_DIR=$(mktemp -d)
  trap 'rm -rf "$KEEP_DIR"' EXIT
  grep -v -E '^[[:space:]]*torch[[:space:]]*([=<>!~;[]|$)' requirements.txt > "$KEEP_DIR/requirements.txt"
  echo "torch==$KEEP_TORCH" > "$KEEP_DIR/constraints.txt"
  REQUIREMENTS=(-r "$KEEP_DIR/requirements.txt")
  CONSTRAINTS=(-c "$KEEP_DIR/constraints.txt")
  echo "setup: keeping this venv's torch $KEEP_TORCH (CUDA works, in the supported range) instead of requirements.txt's pin"
fi
# pip byte-compiles what it installs one file after another: about 19,000 files, 40 s on 2 cores.
# Installing with --no-compile and compiling once at the end on every core (compile_site below)
# takes about 25 s. (Leaving it to first imports was tried: test processes starting together then
# compile the same modules side by side, and the suite took 50 s longer.)
COMPILE=(--no-compile)
pip_install() {  # pip's own output (less one known noise line) is shown; a failed install stops set-up with it
  local out status=0
  out=$("$VENV/bin/python" -m pip install -q --disable-pip-version-check "${COMPILE[@]}" "$@" 2>&1) || status=$?
  [ -z "$out" ] || grep -v "is ignored: it is neither a file nor a directory" <<<"$out" || true
  if [ "$status" -ne 0 ]; then
    echo "setup: FAILED: pip install $* (exit status $status; pip's output is above)" >&2
    return "$status"
  fi
}
pip_install "${REQUIREMENTS[@]}" "${CONSTRAINTS[@]}"
pip_install --no-deps -e .
# DeepSpeed (its FLOPs profiler and scheduler are independent references in the tests), CPU-only:
# no ops compiled. Optional for users: a node where it does not install still trains (its tests
# then skip, with the reason); required where EPAS_REQUIRE_DEEPSPEED=1 (.ci/run sets it).
if ! DS_BUILD_OPS=0 pip_install --no-build-isolation "${CONSTRAINTS[@]}" "deepspeed==0.19.8"; then
  if [ "${EPAS_REQUIRE_DEEPSPEED:-0}" = 1 ]; then
    echo "setup: deepspeed is required here (EPAS_REQUIRE_DEEPSPEED=1): its tests are independent checks" >&2
    exit 1
  fi
  echo "setup: deepspeed not installed (optional for training; its tests will skip)"
fi
# Failures are left to Python, as pip leaves them: a file that does not compile (a package's
# Python 2 template, say) is never imported, and bytecode only saves time.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, megatron.core, epas_megatron; print(f'setup: torch {torch.__version__}, megatron-core {megatron.core.__version__}, epas-megatron {epas_megatron.__version__}')" 2>&1 | grep "^setup:"
