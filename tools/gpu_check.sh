#!/usr/bin/env bash
# Prove the GPU paths on a (possibly bare, offline) GPU node: set up, run the GPU suite and a short
# benchmark at the 125m shape, and print what ran, on what, with pass/fail/skip and reasons.
#
#   tools/gpu_check.sh                       # set up .venv-gpu, run everything
#   WHEELS=/shared/wheels tools/gpu_check.sh # offline: install only from a directory of wheels
#   tools/gpu_check.sh --dry-run             # print what would be installed and run; exit 0
#
# Environment:
#   PYTHON   interpreter with (ideally) the node's own CUDA torch; default: python3.12, then python3
#   VENV     virtual environment to create, with the node's site-packages visible (so the node's
#            torch, Triton and CUDA libraries are used as they are); VENV=system installs into
#            PYTHON's own environment instead. Default: .venv-gpu
#   WHEELS   directory of wheels (megatron-core 0.19.x and anything the node lacks): pip runs with
#            --no-index --find-links WHEELS, no network needed
#   OUT      report directory (default: gpu_check_out): junit XML, logs, gpu_check.json
#   BENCH    0 skips the benchmark (default 1); BENCH_ITERS timed iterations (default 20)
#
# The node needs a CUDA build of torch (any recent one: the package is installed with --no-deps and
# does not pin the node's torch). Transformer Engine is used when it imports; its tests skip
# otherwise. Exit status: 0 when nothing failed (skips are reported, not failures).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $arg (only --dry-run)" >&2; exit 2 ;;
    esac
done
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-gpu_check_out}
BENCH=${BENCH:-1}
BENCH_ITERS=${BENCH_ITERS:-20}

say() { printf '%s\n' "$*"; }
run() {  # print (copy-pasteable), then run unless --dry-run
    say "+ $(printf '%q ' "$@")"
    if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}

# ---- interpreter
if [[ -z "${PYTHON:-}" ]]; then
    for candidate in python3.12 python3; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            PYTHON=$(command -v "$candidate"); break
        fi
    done
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ $DRY_RUN == 1 ]]; then PYTHON=python3.12; say "note: no Python >= 3.12 here; showing the plan for python3.12"
    else say "error: Python >= 3.12 not found (megatron-core 0.17+ needs it); set PYTHON=/path/to/python3.12" >&2; exit 2; fi
fi

# ---- environment
PIP_SOURCE=()
if [[ -n "${WHEELS:-}" ]]; then
    [[ $DRY_RUN == 1 || -d "$WHEELS" ]] || { say "error: WHEELS=$WHEELS is not a directory" >&2; exit 2; }
    PIP_SOURCE=(--no-index --find-links "$WHEELS")
fi
if [[ "$VENV" == system ]]; then
    PY=$PYTHON
else
    PY=$VENV/bin/python
    if [[ $DRY_RUN == 1 || ! -x "$PY" ]]; then
        run "$PYTHON" -m venv --system-site-packages "$VENV"
    fi
fi
have() { command -v "$PY" >/dev/null 2>&1 && "$PY" -c "import $1" >/dev/null 2>&1; }

if ! have torch; then
    run "$PY" -m pip install -q "${PIP_SOURCE[@]}" torch
fi
if ! have megatron.core; then
    run "$PY" -m pip install -q --no-deps "${PIP_SOURCE[@]}" "megatron-core>=0.19.2,<0.20"
fi
# What the package needs at run time besides torch and megatron-core; the node usually has most.
for pair in numpy:numpy packaging:packaging yaml:pyyaml sentencepiece:sentencepiece psutil:psutil \
            tensorboard:tensorboard transformers:transformers safetensors:safetensors pytest:pytest; do
    module=${pair%%:*} dist=${pair##*:}
    have "$module" || run "$PY" -m pip install -q "${PIP_SOURCE[@]}" "$dist"
done
run "$PY" -m pip install -q --no-deps --no-build-isolation -e .

# ---- what this node is
run mkdir -p "$OUT"
if [[ $DRY_RUN == 0 ]]; then
    "$PY" - <<'EOF' | tee "$OUT/environment.txt"
import importlib, platform, subprocess
import torch
def version(name):
    try:
        module = importlib.import_module(name)
        return getattr(module, "__version__", "installed")
    except Exception as error:
        return f"not available ({type(error).__name__})"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE"
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
except Exception:
    driver = "unknown"
print(f"device: {gpu} x {torch.cuda.device_count()} | driver {driver} | CUDA {torch.version.cuda}")
print(f"python {platform.python_version()} | torch {torch.__version__} | megatron-core {version('megatron.core')}")
print(f"transformer_engine {version('transformer_engine')} | apex {version('apex')} | flash_attn {version('flash_attn')} | triton {version('triton')}")
from epas_megatron.model.fusions import KernelAvailability, describe, fusion_settings
print(describe(fusion_settings(KernelAvailability.detect())))
EOF
fi

# ---- the GPU suite
status=0
run "$PY" -m pytest -m gpu tests/gpu -rA -q -p no:cacheprovider --junitxml "$OUT/gpu_suite.xml" || status=$?

# ---- a short benchmark at the 125m shape, seq 2048
if [[ $BENCH == 1 ]]; then
    run "$PY" -m epas_megatron.bench.cli train --preset 125m --seq-length 2048 --micro-batch-size 4 \
        --iters "$BENCH_ITERS" --blocks 4 --warmup 3 || status=$?
fi

# ---- report
if [[ $DRY_RUN == 0 ]]; then
    "$PY" - "$OUT" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
try:
    root = ET.parse(f"{out}/gpu_suite.xml").getroot()
except Exception as error:
    print(f"no suite report: {error}"); sys.exit(0)
rows = {"passed": [], "failed": [], "skipped": []}
for case in root.iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    if case.find("failure") is not None or case.find("error") is not None:
        rows["failed"].append(name)
    elif case.find("skipped") is not None:
        rows["skipped"].append(f"{name} ({case.find('skipped').get('message', '')})")
    else:
        rows["passed"].append(name)
print(f"GPU suite: {len(rows['passed'])} passed, {len(rows['failed'])} failed, {len(rows['skipped'])} skipped")
for kind in ("failed", "skipped"):
    for row in rows[kind]:
        print(f"  {kind}: {row}")
env = open(f"{out}/environment.txt").read().splitlines()
json.dump({"environment": env, **rows}, open(f"{out}/gpu_check.json", "w"), indent=1)
print(f"report: {out}/gpu_check.json")
EOF
fi
exit $status
