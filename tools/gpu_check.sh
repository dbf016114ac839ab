#!/usr/bin/env bash
# Prove the GPU paths on a bare, offline GPU node in one command, in under 10 minutes: check the
# node's own CUDA torch (never replaced), install what the node lacks from a folder of wheels, run
# the GPU suite (pytest -m gpu tests/gpu) and a short benchmark at the 125m shape, and print a row
# for the GPU ledger (docs/gpu-ledger.md) (device, driver, CUDA, torch, megatron-core, TE, pass/fail/skip with
# reasons), ready to paste.
#
# On the GPU node, with the checkout and the wheel folder side by side (epas-megatron/, gpu_wheels/):
#
#   cd epas-megatron && tools/gpu_check.sh
#
# The wheel folder is made on any machine with PyPI access (Linux x86-64 / CPython 3.12 wheels of
# megatron-core, numpy, pytest, tensorboard, ...; never torch, triton or nvidia-*; about 42 MiB):
#
#   tools/gpu_wheels.sh ../gpu_wheels      # then copy epas-megatron/ and gpu_wheels/ to the node
#
# With Transformer Engine: a TE wheelhouse (tools/te_wheels.py build ../te_wheels --node node.txt,
# on any Linux x86-64 machine with PyPI access) holds TE built for the node's torch and GPU and
# everything else the check needs there. Found as ../te_wheels (or WHEELS=/path/to/it), it is
# installed like the folder above, and the check then runs the TE layers: the node's torch and GPU
# architecture must be the ones it was built for, TE must load (and run a bf16 te.Linear on the
# GPU) or the check stops with one line naming what is missing -- never falling back to local
# layers --, and the suite's TE tests and the benchmark use --transformer-impl transformer_engine
# (the suite's TE tests ask for it; the benchmark's 'auto' takes TE where it loads, as the row shows).
#
# Modes:
#   tools/gpu_check.sh --dry-run        print the plan (checks, installs, commands); exit 0; any machine
#   tools/gpu_check.sh --setup-only     check torch, install what is missing, import-check; no GPU needed
#   tools/gpu_check.sh --report DIR     print the ledger row of an earlier run's OUT directory again
#   tools/gpu_check.sh --requirements   print what the check installs where missing (gpu_wheels.sh reads it)
#
# Environment:
#   PYTHON        the node's python, with its CUDA torch (default: the first of python3.12, python3,
#                 python that imports torch)
#   WHEELS        folder made by tools/gpu_wheels.sh or tools/te_wheels.py (default: ../te_wheels beside
#                 the checkout, else ../gpu_wheels, where one exists). Only its wheels are installed (pip
#                 --no-index --no-deps), and only those that fill a gap: each requirement is checked
#                 against what the node has. A node with network access makes the folder itself:
#                 tools/gpu_wheels.sh ../gpu_wheels. A folder from tools/te_wheels.py (its MANIFEST.txt
#                 names the torch, GPU architecture and TE version it was built for) adds
#                 transformer-engine[pytorch] to what is installed, and TE is pointed at the node's
#                 cuDNN, NVRTC and cuRAND (CUDNN_PATH, NVRTC_PATH, CURAND_PATH) and NVIDIA libraries
#                 (LD_LIBRARY_PATH), all from the nvidia/ packages beside PYTHON's torch
#   VENV          where missing packages go (default: .venv-gpu): a virtual environment that sees
#                 PYTHON's packages (torch, Triton, CUDA libraries are used as they are, also when PYTHON
#                 is itself a venv). Made without pip where PYTHON has one (PYTHON's pip serves it), so a
#                 python without ensurepip (Debian/Ubuntu without python3.X-venv) still makes it.
#                 VENV=system installs into PYTHON's own environment instead (where PYTHON cannot make a
#                 venv at all), with pip --break-system-packages where that environment is externally
#                 managed (PEP 668).
#   OUT           report directory (default: gpu_check_out): environment.json, gpu_suite.xml and .log,
#                 bench.log, stopped.txt (why the check stopped early), ledger_row.md, gpu_check.json,
#                 te_load.log (where TE did not load), node.txt (this node's Python, torch, GPU architecture
#                 and packages: what tools/te_wheels.py build --node reads to make a TE wheelhouse for it)
#   TIME_LIMIT    seconds for the whole check, worst case included (default 570; the GPU lender's hard
#                 limit is 600 per call): every step runs under timeout within it, kill-after grace
#                 included, and 20 s are kept for the report. The suite gets what set-up and the
#                 benchmark leave, and is stopped (its results so far kept) when that is spent
#   TEST_TIMEOUT  seconds per test (default 240; pytest-timeout, which the wheel folder brings)
#   BENCH         0 skips the benchmark (default 1); BENCH_ITERS timed iterations (default 20);
#                 BENCH_TIMEOUT seconds (default 120)
#
# Exit status: 0 when nothing failed (skips are reported with their reasons); 1 when a test or the
# benchmark failed or ran out of time (set-up included); 2 when this node cannot run the check (no
# CUDA torch, torch outside the supported range, no usable GPU, packages missing and no wheel folder,
# an install or import that fails, a TE wheelhouse built for another torch or GPU, a TE that does not
# load). Once PYTHON and its GPU are known, every exit writes the ledger
# row (OUT/ledger_row.md, printed), a stop with its reason: 'check stopped: import check failed: ...'.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

# What the GPU suite and the benchmark import besides the node's torch (and what torch brings:
# Triton, the CUDA libraries). tools/gpu_wheels.sh downloads these and their dependencies.
REQUIREMENTS=(
    "megatron-core>=0.19.2,<0.20"
    "numpy>=1.26"
    "packaging>=24.2"
    "pyyaml>=6.0"
    "sentencepiece>=0.2"
    "psutil>=5.9"
    "pytest>=8.0"
    "pytest-timeout>=2.3"
    # TensorBoard logging is on by default in every epas-train run (launch/configs/125m.yaml says so
    # too): a user's first real run on the node needs it, though the suite and the benchmark do not.
    # Its wheels (tensorboard, tensorboard-data-server, grpcio, protobuf, pillow, werkzeug, markdown,
    # absl-py) are pure or manylinux cp312; setuptools and markupsafe come with the node's torch.
    "tensorboard>=2.16"
)

MODE=run DRY_RUN=0 REPORT_DIR=
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --setup-only) MODE=setup ;;
        --report) MODE=report; REPORT_DIR=${2:?"error: --report needs the OUT directory of a run"}; shift ;;
        --requirements) MODE=requirements ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "error: unknown argument $1 (--dry-run, --setup-only, --report DIR, --requirements, --help)" >&2; exit 2 ;;
    esac
    shift
done
if [[ $MODE == requirements ]]; then printf '%s\n' "${REQUIREMENTS[@]}"; exit 0; fi

OUT=${OUT:-gpu_check_out}
VENV=${VENV:-.venv-gpu}
TIME_LIMIT=${TIME_LIMIT:-570}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
BENCH=${BENCH:-1}
BENCH_ITERS=${BENCH_ITERS:-20}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-120}
[[ $BENCH == 0 || $BENCH == 1 ]] || { echo "error: BENCH=$BENCH: 1 runs the benchmark, 0 skips it" >&2; exit 2; }
for knob in TIME_LIMIT TEST_TIMEOUT BENCH_ITERS BENCH_TIMEOUT; do
    [[ ${!knob} =~ ^[0-9]+$ ]] || { echo "error: $knob=${!knob} is not a whole number of seconds/iterations" >&2; exit 2; }
done

# The time budget. TIME_LIMIT bounds the worst case, not the usual one: every step runs under
# timeout, and what timeout may add after its limit (--kill-after, for a process that ignores the
# first signal) is counted inside TIME_LIMIT. Set-up steps must end by DEADLINE (SIGTERM, then SIGKILL
# STEP_KILL_AFTER later); the suite gets SIGINT at its limit (pytest then writes its report) and
# SIGKILL SUITE_KILL_AFTER later; the benchmark the same with BENCH_KILL_AFTER; REPORT_RESERVE
# after DEADLINE is the report's (and, after a stop, the environment's last update).
STEP_KILL_AFTER=5 SUITE_KILL_AFTER=30 BENCH_KILL_AFTER=15 REPORT_RESERVE=20
BENCH_SHARE=$(( BENCH == 1 ? BENCH_TIMEOUT + BENCH_KILL_AFTER : 0 ))
DEADLINE=$(( TIME_LIMIT - REPORT_RESERVE ))
if [[ $MODE == run ]] && (( DEADLINE - SUITE_KILL_AFTER - BENCH_SHARE < 1 )); then
    echo "error: TIME_LIMIT=$TIME_LIMIT leaves the GPU suite no time: the benchmark takes up to $BENCH_SHARE s" \
         "(BENCH_TIMEOUT=$BENCH_TIMEOUT + ${BENCH_KILL_AFTER} s grace), the suite's grace ${SUITE_KILL_AFTER} s, the report" \
         "${REPORT_RESERVE} s: raise TIME_LIMIT (at most 600 on the GPU lender), lower BENCH_TIMEOUT or set BENCH=0" >&2
    exit 2
fi

say() { printf '%s\n' "$*"; }
quote() {  # the words of a command line, shell-quoted where they need it (copy-pasteable)
    local word line=
    for word in "$@"; do
        if [[ "$word" =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then line+="$word "; else line+="'${word//\'/\'\\\'\'}' "; fi
    done
    printf '%s' "${line% }"
}
run() {  # print (copy-pasteable), then run unless --dry-run
    say "+ $(quote "$@")"
    if [[ $DRY_RUN == 0 ]]; then "$@"; fi
}
# "$@" under timeout, ended (SIGTERM, then SIGKILL) by the set-up's DEADLINE; 124 or 137 when it
# ran out of time (or there was none left to start it).
bounded() {
    local limit=$(( DEADLINE - SECONDS - STEP_KILL_AFTER ))
    (( limit >= 1 )) || return 124
    timeout --kill-after="$STEP_KILL_AFTER" "$limit" "$@"
}
timed_out() { [[ $1 == 124 || $1 == 137 ]]; }
# A set-up command: printed (copy-pasteable), then run within the set-up's deadline unless --dry-run.
# Returns the command's status; running out of time stops the check (status 1).
step() {  # $1: what it is (for the messages); the rest: the command
    local what=$1 status=0
    shift
    say "+ $(quote "$@")"
    [[ $DRY_RUN == 1 ]] && return 0
    bounded "$@" || status=$?
    if timed_out "$status"; then
        STOP_STATUS=1 stop "$what ran out of time: set-up must end by ${DEADLINE}s of TIME_LIMIT=${TIME_LIMIT}s (the rest is the suite's, the benchmark's and the report's); raise TIME_LIMIT"
    fi
    return "$status"
}
# A check that stops a real run (status STOP_STATUS, default 2); under --dry-run it is reported and the
# plan goes on. Once the environment is known (LEDGER=1), the exit writes the ledger row with the reason.
STOP_STATUS=2 LEDGER=0 STAGE="the start" REPORTED=0
stop() {
    if [[ $DRY_RUN == 1 ]]; then say "note: a real run would stop here: $*"; return 0; fi
    say "error: $*" >&2
    if [[ $LEDGER == 1 ]]; then printf '%s\n' "$*" >"$OUT/stopped.txt"; fi
    exit "$STOP_STATUS"
}

# ---- the ledger row (also --report DIR): stdlib only, reads what a run left in OUT
ledger_report() {  # $1: python, $2: OUT directory, $3: seconds it may take (default 60; killed 2 s later)
    timeout --kill-after=2 "${3:-60}" "$1" - "$2" <<'EOF'
import json, re, sys, xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

out = Path(sys.argv[1])

def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")

def read(name, default=""):
    path = out / name
    return path.read_text() if path.exists() else default

env = json.loads(read("environment.json", "{}"))
stopped = read("stopped.txt").strip()  # why the check stopped before its end (stop() wrote it)
suite_status = read("gpu_suite.status").strip()
passed, failed, skipped = [], [], []
try:
    root = ET.parse(out / "gpu_suite.xml").getroot()
except (OSError, ET.ParseError) as error:
    root = None
    suite_problem = "GPU suite not run" if stopped and not suite_status else f"no suite report ({type(error).__name__})"
for case in (root.iter("testcase") if root is not None else ()):
    if not case.get("name"):
        continue  # the test running when the suite was stopped
    name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
    if case.find("failure") is not None or case.find("error") is not None:
        node = case.find("failure") if case.find("failure") is not None else case.find("error")
        failed.append((name, (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""))
    elif case.find("skipped") is not None:
        skipped.append((name, case.find("skipped").get("message", "").removeprefix("Skipped: ")))
    else:
        passed.append(name)

parts = [f"check stopped: {stopped}"] if stopped else []
if root is None:
    parts.append(suite_problem)
else:
    parts.append(f"GPU suite: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
if suite_status in ("124", "137"):  # timeout's statuses: stopped at SIGINT, or killed after its grace
    running = ""
    for line in read("gpu_suite.log").splitlines():
        match = re.match(r"^(tests/gpu/\S+::\S+)\s*$", line)
        running = match.group(1) if match else running
    killed = " (killed: it did not stop at SIGINT)" if suite_status == "137" else ""
    parts.append(f"stopped at its time limit{f' in {running}' if running else ''}{killed}")
if skipped:
    reasons = Counter(reason for _, reason in skipped)
    parts.append("skipped: " + "; ".join(f"{reason} (x{n})" for reason, n in reasons.most_common()))
if failed:
    parts.append("failed: " + "; ".join(name for name, _ in failed))
bench_status = read("bench.status").strip()
bench = None
for line in read("bench.log").splitlines():
    if line.startswith("BENCH "):
        bench = json.loads(line[len("BENCH "):])
if bench is not None:
    parts.append(f"bench train {bench.get('preset')} seq {bench.get('seq_length')} ({bench.get('precision')}, {bench.get('backend')}): "
                 f"EPAS/baseline {bench.get('ratio', float('nan')):.3f} (FLOP limit {bench.get('flop_limit_ratio', float('nan')):.3f}), "
                 f"baseline {bench.get('baseline_tokens_per_s', 0):,.0f} tok/s")
elif bench_status == "skipped":
    parts.append("bench not run (BENCH=0)")
elif bench_status.startswith("not run"):
    parts.append(f"bench {bench_status}")
elif bench_status:
    parts.append("bench " + ("stopped at its time limit" if bench_status in ("124", "137") else f"failed (exit {bench_status})"))

device = env.get("device", "unknown device")
row = (f"| {env.get('date', '?')} | {cell(device)} x{env.get('device_count', '?')} (driver {cell(env.get('driver', '?'))}) "
       f"| {cell(env.get('torch', '?'))} (CUDA {cell(env.get('cuda', '?'))}) | {cell(env.get('megatron_core', '?'))} "
       f"| {cell(env.get('transformer_engine', '?'))} | {cell('; '.join(parts))} |")
ok = not stopped and root is not None and not failed and suite_status in ("0", "") and bench_status in ("0", "skipped", "")
if stopped:
    print(f"check stopped: {stopped}")
print(f"GPU suite: {len(passed)} passed, {len(failed)} failed, {len(skipped)} skipped")
for name, message in failed:
    print(f"  failed: {name}: {message}")
for name, reason in skipped:
    print(f"  skipped: {name}: {reason}")
print()
print("GPU ledger row (docs/gpu-ledger.md, section 'Runs of the GPU check'):")
print(row)
(out / "ledger_row.md").write_text(row + "\n")
json.dump({"environment": env, "stopped": stopped or None, "passed": passed, "failed": failed, "skipped": skipped,
           "suite_status": suite_status, "bench": bench, "bench_status": bench_status, "ledger_row": row, "ok": ok},
          open(out / "gpu_check.json", "w"), indent=1)
print(f"report: {out}/gpu_check.json")
sys.exit(0 if ok else 1)
EOF
}

if [[ $MODE == report ]]; then
    [[ -d "$REPORT_DIR" ]] || { echo "error: --report $REPORT_DIR is not a directory (the OUT of a gpu_check.sh run)" >&2; exit 2; }
    ledger_report "${PYTHON:-python3}" "$REPORT_DIR"
    exit $?
fi

# Every exit once the environment is known (LEDGER=1) writes the ledger row: a stop() has written
# its reason to OUT/stopped.txt; any other early exit (a command failing under set -e) is named by
# the stage it happened in. Where the full probe (section 4) has not run, the environment's
# package versions are read first (metadata only: nothing is imported). Both within REPORT_RESERVE.
on_exit() {
    local status=$1
    trap - EXIT
    if [[ $LEDGER == 1 && $REPORTED == 0 ]]; then
        [[ -s "$OUT/stopped.txt" ]] || printf '%s\n' "stopped during $STAGE (exit $status)" >"$OUT/stopped.txt"
        timeout --kill-after=2 6 "$PY" - "$OUT/environment.json" <<'PYEOF' || true
import json, sys
from importlib import metadata
path = sys.argv[1]
env = json.load(open(path))
if "fusions" not in env:  # the full probe did not run: the versions this environment has
    for key, name in (("megatron_core", "megatron-core"), ("transformer_engine", "transformer-engine")):
        try:
            version = metadata.version(name)
            env[key] = f"yes ({version})" if key == "transformer_engine" else version
        except metadata.PackageNotFoundError:
            env[key] = "no" if key == "transformer_engine" else "not installed"
    json.dump(env, open(path, "w"), indent=1)
PYEOF
        say "gpu_check.sh took ${SECONDS}s"
        report_within 8 || true
    fi
    exit "$status"
}
# The ledger report, killed after $1 seconds (+2): a hung report cannot push the check past TIME_LIMIT.
report_within() { ledger_report "$PY" "$OUT" "$1"; }
trap 'on_exit $?' EXIT

[[ $DRY_RUN == 1 ]] && say "gpu_check.sh --dry-run: the plan (nothing is installed or run)"

# ---- 1. the node's python and its torch, checked before anything else
STAGE="the torch check"
if [[ -z "${PYTHON:-}" ]]; then
    for candidate in python3.12 python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 && bounded "$candidate" -c 'import sys, torch; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
            PYTHON=$(command -v "$candidate"); break
        fi
    done
fi
PYTHON_FOUND=1
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3.12 PYTHON_FOUND=0
    stop "no python >= 3.12 with torch found (tried python3.12, python3, python); set PYTHON=/path/to/the/node's/python (the one whose torch is a CUDA build)"
fi
say "python: $PYTHON"
NEED_GPU=1
[[ $MODE == setup ]] && NEED_GPU=0
# Prints, as its last line, what the ledger row needs to know of this node (JSON: torch, CUDA, the
# GPU, the driver) on success; else one line saying why, and exits 2.
torch_check() {
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" bounded "$PYTHON" - "$NEED_GPU" <<'PYEOF'
import datetime, json, platform, sys
need_gpu = sys.argv[1] == "1"
if sys.version_info < (3, 12):
    print(f"PYTHON is Python {sys.version.split()[0]}; megatron-core 0.17+ needs >= 3.12: set PYTHON=/path/to/python3.12 (the one with the node's CUDA torch)")
    sys.exit(2)
try:
    import torch
except Exception as error:
    print(f"PYTHON={sys.executable} cannot import torch ({type(error).__name__}: {error}); gpu_check.sh uses the node's own "
          f"CUDA torch and never installs one: set PYTHON to the python that has it")
    sys.exit(2)
from epas_megatron.runtime.accelerator import accelerator_problem, detect, torch_version_problem
facts = detect()
if not facts.torch_cuda:
    print(f"{facts.torch_build} at {torch.__file__}: the GPU check needs a CUDA build of torch; set PYTHON to the node's python "
          f"with its CUDA torch (gpu_check.sh never installs torch)")
    sys.exit(2)
problem = torch_version_problem(facts.torch_version) or accelerator_problem(facts)
if problem:
    print(problem)
    sys.exit(2)
if need_gpu and not facts.cuda_available:
    hidden = f" (CUDA_VISIBLE_DEVICES={facts.cuda_visible_devices!r})" if facts.cuda_visible_devices is not None else ""
    print(f"no usable CUDA device: torch.cuda.is_available() is False{hidden}; run gpu_check.sh on a GPU node "
          f"(--dry-run and --setup-only work anywhere)")
    sys.exit(2)
env = {"date": datetime.date.today().isoformat(), "torch": facts.torch_version, "cuda": facts.torch_cuda,
       "driver": facts.driver_version or "unknown", "python": platform.python_version()}
if facts.cuda_available:
    env.update(device=torch.cuda.get_device_name(), device_count=torch.cuda.device_count())
    try:  # the GPU architecture a TE wheelhouse must have been trimmed to
        env["arch"] = "sm_%d%d" % torch.cuda.get_device_capability()
    except Exception:
        pass
print(json.dumps(env))
PYEOF
}
TORCH_STATUS=0 NODE_FACTS=
if [[ $PYTHON_FOUND == 1 ]]; then
    TORCH_OUT=$(torch_check 2>&1) || TORCH_STATUS=$?
    if [[ $TORCH_STATUS == 0 ]]; then
        NODE_FACTS=$(tail -n 1 <<<"$TORCH_OUT")
        say "torch: $("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["torch"])' "$NODE_FACTS") (a CUDA build in the supported range; used as it is, never replaced)"
    elif timed_out "$TORCH_STATUS"; then
        STOP_STATUS=1 stop "the torch check ($PYTHON importing torch, looking at the GPU) ran out of time (TIME_LIMIT=${TIME_LIMIT}s)"
    else
        stop "$(tail -n 1 <<<"$TORCH_OUT")"
    fi
fi

# From here on the environment is known: a real run keeps what it learns in OUT, and every exit
# writes the ledger row (on_exit). What an earlier run left there goes first.
PY=$PYTHON
if [[ $DRY_RUN == 0 && $MODE == run ]]; then
    mkdir -p "$OUT"
    rm -f "$OUT"/environment.json "$OUT"/stopped.txt "$OUT"/gpu_suite.* "$OUT"/bench.* "$OUT"/ledger_row.md "$OUT"/gpu_check.json \
          "$OUT"/te_load.log "$OUT"/node.txt
    printf '%s\n' "$NODE_FACTS" >"$OUT/environment.json"
    LEDGER=1
    # The node, as tools/te_wheels.py build --node reads it (the one-line command in its --help, with
    # PYTHON): bring it back to make a TE wheelhouse that carries only what this node lacks.
    bounded "$PYTHON" -c "import torch, platform, importlib.metadata as m; print('node: python', platform.python_version(), 'torch', torch.__version__, 'arch', 'sm_%d%d' % torch.cuda.get_device_capability()); [print(f'{d.name}=={d.version}') for d in m.distributions()]" \
        >"$OUT/node.txt" 2>/dev/null || rm -f "$OUT/node.txt"
fi

# ---- 2. what the node lacks, installed from the wheel folder only (torch is never touched)
# The plan is made here, not by pip's resolver: pip would re-resolve the node's whole torch tree
# (vendor builds such as NGC's 2.6.0a0 do not even satisfy megatron-core's torch>=2.6.0), so each
# requirement (and, recursively, each requirement of what is installed or chosen) is checked
# against the environment, and only the wheels that fill a gap are installed, with --no-deps.
install_plan() {  # $1: python of the target environment, $2: wheel folder (may be empty or absent)
    bounded "$1" - "$2" "${REQUIREMENTS[@]}" <<'EOF'
import email.parser, re, sys, zipfile
from importlib import metadata
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

folder = Path(sys.argv[1]) if sys.argv[1] else None
wheels = {}
for path in (folder.glob("*.whl") if folder and folder.is_dir() else ()):
    name, version, _, _ = parse_wheel_filename(path.name)
    wheels.setdefault(name, []).append((version, path))


def node_owned(name):  # the node's torch and what comes with it: checked before, never installed
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))


def applicable(lines, extras):
    result = []
    for line in lines or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in {"", *extras}):
            result.append(req)
    return result


def wheel_requires(path):
    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        return email.parser.Parser().parsestr(archive.read(meta).decode()).get_all("Requires-Dist")


def installed(name):
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


plan, missing, seen = {}, [], set()
queue = [(Requirement(spec), "tools/gpu_check.sh") for spec in sys.argv[2:]]
while queue:
    req, parent = queue.pop(0)
    name = canonicalize_name(req.name)
    key = (name, str(req.specifier), tuple(sorted(req.extras)))
    if key in seen or node_owned(name):
        continue
    seen.add(key)
    have = plan[name][0] if name in plan else installed(name)
    if have is not None and req.specifier.contains(have, prereleases=True):
        lines = wheel_requires(plan[name][1]) if name in plan else metadata.requires(name)
    else:
        fits = sorted((v, p) for v, p in wheels.get(name, []) if req.specifier.contains(v, prereleases=True))
        if not fits:
            missing.append(f"{req} (for {parent}; {f'{have} here' if have else 'not here'}, no wheel of it in {folder or 'no wheel folder'})")
            continue
        plan[name] = fits[-1]
        lines = wheel_requires(fits[-1][1])
    queue.extend((dep, name) for dep in applicable(lines, req.extras))
for text in missing:
    print(f"missing {text}")
for name in sorted(plan):
    print(f"install {plan[name][1]}")
EOF
}
link_node_packages() {  # VENV sees PYTHON's packages. A .pth file, not --system-site-packages: where PYTHON
    # is itself a venv (as on many GPU images), --system-site-packages would show its base python's instead.
    local site_dirs pth
    site_dirs=$(bounded "$PYTHON" -c 'import os, sys; print("\n".join(p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages") and os.path.isdir(p)))')
    pth=$(bounded "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_gpu_check_node_packages.pth
    say "+ # $pth: site.addsitedir() of PYTHON's $(tr '\n' ' ' <<<"$site_dirs")"
    while IFS= read -r dir; do
        [[ -n "$dir" ]] && printf 'import site; site.addsitedir(%s)\n' "$("$PYTHON" -c 'import sys; print(repr(sys.argv[1]))' "$dir")"
    done <<<"$site_dirs" >"$pth"
}

STAGE="the install"
if [[ -z "${WHEELS:-}" ]]; then  # a TE wheelhouse first: carried beside the checkout, it is meant to be used
    for candidate in te_wheels gpu_wheels; do
        if [[ -d "$REPO/../$candidate" ]]; then WHEELS=$(cd "$REPO/../$candidate" && pwd); break; fi
    done
fi
if [[ -n "${WHEELS:-}" && ! -d "$WHEELS" ]]; then
    stop "WHEELS=$WHEELS is not a directory: set WHEELS to the folder tools/gpu_wheels.sh or tools/te_wheels.py made"
fi
say "wheels: ${WHEELS:-none (no WHEELS, no ../te_wheels or ../gpu_wheels beside the checkout)}"

# ---- 2a. Transformer Engine, where WHEELS is a TE wheelhouse (tools/te_wheels.py: its MANIFEST.txt
# has '# target: python=3.12 torch=2.11.0+cu130 arch=sm_90 transformer-engine=2.20.2'). The extension
# is built against one torch, the core library holds device code for one GPU architecture: both are
# checked against this node before anything is installed.
TE_VERSION=
if [[ -n "${WHEELS:-}" && -f "$WHEELS/MANIFEST.txt" ]] && TE_TARGET=$(grep -m1 '^# target: ' "$WHEELS/MANIFEST.txt"); then
    if [[ ! $TE_TARGET =~ torch=([^ ]+)\ arch=(sm_[0-9]+)\ transformer-engine=([^ ]+) ]]; then
        stop "WHEELS=$WHEELS/MANIFEST.txt: unreadable target line '$TE_TARGET': remake the folder with tools/te_wheels.py"
    fi
    TE_TORCH=${BASH_REMATCH[1]} TE_ARCH=${BASH_REMATCH[2]} TE_VERSION=${BASH_REMATCH[3]}
    say "Transformer Engine: $TE_VERSION from $WHEELS (built against torch $TE_TORCH, device code for $TE_ARCH only)"
    REQUIREMENTS+=("transformer-engine[pytorch]==$TE_VERSION")
    NODE_TORCH= NODE_ARCH=
    if [[ -n "$NODE_FACTS" ]]; then
        NODE_TORCH=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])["torch"])' "$NODE_FACTS")
        NODE_ARCH=$("$PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1]).get("arch", ""))' "$NODE_FACTS")
    elif [[ $PYTHON_FOUND == 1 ]]; then  # --dry-run where the torch check did not pass: its torch still tells
        NODE_TORCH=$(bounded "$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) || NODE_TORCH=
    fi
    if [[ -n $NODE_TORCH ]]; then
        REMAKE="remake it from this node's list: on the node, the command at the end of 'tools/te_wheels.py --help' writes node.txt; then, on a machine with PyPI access, tools/te_wheels.py build ../te_wheels --node node.txt"
        if [[ $NODE_TORCH != "$TE_TORCH" ]]; then
            stop "the TE wheelhouse WHEELS=$WHEELS was built against torch $TE_TORCH, this node's is $NODE_TORCH (the extension runs with that exact torch only): $REMAKE"
        elif [[ -n $NODE_ARCH && $NODE_ARCH != "$TE_ARCH" ]]; then
            stop "the TE wheelhouse WHEELS=$WHEELS holds device code for $TE_ARCH only, this GPU is $NODE_ARCH: $REMAKE"
        fi
    fi
fi
PIP_INSTALL=(-m pip --isolated install -q --disable-pip-version-check --no-index --no-deps)
if [[ $VENV != system ]]; then
    if [[ $DRY_RUN == 1 || ! -x "$VENV/bin/python" ]]; then
        # Without pip where PYTHON has one: the venv runs PYTHON's pip through the link below (pip
        # installs into the environment of the python that runs it), so no ensurepip is needed --
        # Debian and Ubuntu ship ensurepip only in python3.X-venv, the usual reason '-m venv' fails.
        VENV_ARGS=()
        if [[ $PYTHON_FOUND == 1 ]] && bounded "$PYTHON" -m pip --version >/dev/null 2>&1; then VENV_ARGS=(--without-pip); fi
        step "making the virtual environment" "$PYTHON" -m venv ${VENV_ARGS[@]+"${VENV_ARGS[@]}"} "$VENV" \
            || stop "$PYTHON -m venv $VENV failed (its message is above): this python cannot make a virtual environment (Debian/Ubuntu: apt-get install python3.12-venv); or set VENV=system to install the missing wheels into PYTHON's own environment (with pip --break-system-packages where it is externally managed, PEP 668)"
    fi
    if [[ $DRY_RUN == 1 ]]; then say "+ # $VENV/lib/python3.12/site-packages/_gpu_check_node_packages.pth: site.addsitedir() of PYTHON's site-packages"
    else link_node_packages; fi
    PY=$VENV/bin/python
elif [[ $PYTHON_FOUND == 0 || "$(bounded "$PYTHON" -m pip install --help 2>/dev/null)" == *--break-system-packages* ]]; then
    # VENV=system where PYTHON's environment is externally managed (PEP 668: Debian's and Ubuntu's
    # system python) refuses every install unless told otherwise, and --isolated (kept: no pip.conf
    # or PIP_* variable may point this offline install at an index) makes pip ignore
    # PIP_BREAK_SYSTEM_PACKAGES -- so the flag is passed itself. Not --user: PEP 668 refuses user
    # installs as well. Not a --target folder: VENV=system means PYTHON's own environment, where the
    # user's later runs (epas-train on the node) find the packages without a PYTHONPATH. What goes
    # in is only what the plan found missing, --no-deps; torch and its libraries are never touched.
    # A pip that does not know the flag (before 23.0.1) predates PEP 668 and needs none.
    PIP_INSTALL+=(--break-system-packages)
fi
PLAN_PY=$PY  # under --dry-run the venv does not exist: what PYTHON has is what it would see
[[ -x "$PLAN_PY" ]] || PLAN_PY=$PYTHON
PLAN=() MISSING=() INSTALL=() KNOWN=0
if [[ $PYTHON_FOUND == 1 ]] && "$PLAN_PY" -c '' >/dev/null 2>&1; then
    PLAN_STATUS=0
    PLAN_OUT=$(install_plan "$PLAN_PY" "${WHEELS:-}") || PLAN_STATUS=$?
    if timed_out "$PLAN_STATUS"; then STOP_STATUS=1 stop "planning the install ran out of time (TIME_LIMIT=${TIME_LIMIT}s)"; fi
    [[ $PLAN_STATUS == 0 ]] || stop "could not plan the install with $PLAN_PY (its error is above)"
    [[ -z "$PLAN_OUT" ]] || mapfile -t PLAN <<<"$PLAN_OUT"
    KNOWN=1
fi
for line in ${PLAN[@]+"${PLAN[@]}"}; do
    case "$line" in missing\ *) MISSING+=("${line#missing }") ;; install\ *) INSTALL+=("${line#install }") ;; esac
done
if [[ $KNOWN == 0 ]]; then  # --dry-run without the node's python
    say "packages: (not known here) what the node lacks of: ${REQUIREMENTS[*]}, from ${WHEELS:-../gpu_wheels}"
    INSTALL=("${WHEELS:-../gpu_wheels}/<the wheels the node lacks>.whl")
elif [[ ${#MISSING[@]} -gt 0 ]]; then
    say "packages missing here, with no fitting wheel:"; printf '  %s\n' "${MISSING[@]}"
    if [[ -z "${WHEELS:-}" ]]; then
        stop "this node lacks ${#MISSING[@]} package(s) (listed above) and there is no wheel folder: on a machine with PyPI access run tools/gpu_wheels.sh ../gpu_wheels, copy gpu_wheels/ beside this checkout (or set WHEELS=/path/to/it), and run again"
    else
        if [[ -n $TE_VERSION ]]; then
            stop "WHEELS=$WHEELS lacks what this node needs (listed above): remake it with tools/te_wheels.py build ../te_wheels --node node.txt (from this checkout; node.txt read on this node) on a machine with PyPI access"
        else
            stop "WHEELS=$WHEELS lacks what this node needs (listed above): remake it with tools/gpu_wheels.sh (from this checkout) on a machine with PyPI access"
        fi
    fi
fi
if [[ ${#INSTALL[@]} == 0 ]]; then
    say "packages: everything the check imports is here; nothing to install"
else
    say "packages to install from ${WHEELS:-../gpu_wheels} (only what this node lacks; --no-deps, the plan checked every requirement):"
    TARGET=$VENV
    [[ $VENV != system ]] || TARGET="PYTHON's own environment (VENV=system)"
    step "pip install" "$PY" "${PIP_INSTALL[@]}" "${INSTALL[@]}" || stop "pip install into $TARGET failed (pip's message is above)"
    if [[ $DRY_RUN == 0 ]]; then
        STILL_STATUS=0
        STILL=$(install_plan "$PY" "") || STILL_STATUS=$?
        [[ $STILL_STATUS == 0 ]] || stop "could not check the install with $PY (its error is above)"
        [[ -z "$STILL" ]] || stop "after the install, still: $(tr '\n' ';' <<<"$STILL")"
    fi
fi

# ---- 2b. Transformer Engine's libraries. TE's core library needs libnccl.so.2, libcudart, libcublas
# and cuDNN when it loads, and names no path to them (no RUNPATH): unless torch was imported first,
# the dynamic loader finds them only through LD_LIBRARY_PATH (measured: 'import transformer_engine'
# alone fails with "OSError: libnccl.so.2" even beside torch's nvidia/ packages). TE itself looks for
# cuDNN, NVRTC and cuRAND in CUDNN_PATH, NVRTC_PATH, CURAND_PATH, CUDA_HOME, /usr/local/cuda, then in
# the nvidia/ packages of the running environment -- which, in VENV, has none. All are set from the
# nvidia/ packages beside PYTHON's torch (in VENV=system too: the same folders TE would find).
te_library_paths() {  # $1: python; prints NAME=VALUE lines
    bounded "$1" - <<'EOF'
import os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)  # no nvidia/ packages: TE looks in CUDA_HOME and /usr/local/cuda (its own search)
roots = [str(root) for root in nvidia.__path__]
def package(*names):  # the first nvidia/<name> with a lib/ folder (CUDA 13 wheels: cu13; CUDA 12: one per library)
    for name in names:
        for root in roots:
            if os.path.isdir(os.path.join(root, name, "lib")):
                return os.path.join(root, name)
    return None
found = {"CUDNN_PATH": package("cudnn"), "NVRTC_PATH": package("cu13", "cuda_nvrtc"), "CURAND_PATH": package("cu13", "curand")}
for key, value in found.items():
    if value:
        print(f"{key}={value}")
libs = [os.path.join(root, name, "lib") for root in roots for name in sorted(os.listdir(root))
        if os.path.isdir(os.path.join(root, name, "lib"))]
if libs:
    print("LD_LIBRARY_PATH=" + os.pathsep.join(libs + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]))
EOF
}
# A TE the node has itself (no TE wheelhouse) is held to the same rule: it loads, or the check stops.
if [[ -z $TE_VERSION && $PYTHON_FOUND == 1 ]] && "$PLAN_PY" -c '' >/dev/null 2>&1; then
    TE_VERSION=$(bounded "$PLAN_PY" -c 'from importlib import metadata
try:
    print(metadata.version("transformer-engine"))
except metadata.PackageNotFoundError:
    pass' 2>/dev/null) || TE_VERSION=
    [[ -z $TE_VERSION ]] || say "Transformer Engine $TE_VERSION is installed here: it must load (no fall-back to local layers)"
fi
if [[ -n $TE_VERSION && $PYTHON_FOUND == 1 ]]; then
    STAGE="the Transformer Engine set-up"
    TE_PATHS_STATUS=0
    TE_PATHS=$(te_library_paths "$PLAN_PY") || TE_PATHS_STATUS=$?
    [[ $TE_PATHS_STATUS == 0 ]] || stop "could not find the node's NVIDIA libraries with $PLAN_PY (its error is above)"
    [[ $TE_PATHS == *CUDNN_PATH=* ]] || say "note: no nvidia/cudnn package beside PYTHON's torch: TE looks for cuDNN in CUDA_HOME and /usr/local/cuda"
    while IFS= read -r line; do
        [[ -n $line ]] || continue
        say "+ export $(quote "$line")"
        export "${line?}"
    done <<<"$TE_PATHS"
fi

# ---- 3. import check: what the suite, the benchmark and a first real run (TensorBoard on) load
# The checkout is used in place (no install): the folder kernels/ is the package epas_kernels
# (pyproject's package-dir), which a path entry alone cannot rename -- a link named epas_kernels does.
STAGE="the import check"
if [[ $DRY_RUN == 1 ]]; then  # (no folder is made for a plan)
    say "+ KERNELS_PATH=\$(mktemp -d)"
    say "+ ln -s $(quote "$REPO/kernels") \"\$KERNELS_PATH/epas_kernels\""
    KERNELS_PATH='$KERNELS_PATH'
else
    KERNELS_PATH=$(mktemp -d)
    run ln -s "$REPO/kernels" "$KERNELS_PATH/epas_kernels"
fi
say "+ export PYTHONPATH=$REPO:$KERNELS_PATH\${PYTHONPATH:+:\$PYTHONPATH}"
export PYTHONPATH="$REPO:$KERNELS_PATH${PYTHONPATH:+:$PYTHONPATH}"
IMPORTS=(numpy yaml sentencepiece psutil pytest pytest_timeout megatron.core torch.utils.tensorboard epas_megatron.train
         epas_megatron.bench.cli epas_megatron.generate epas_megatron.inference.engine epas_kernels.region_pv)
# One module at a time, so that the stop names the module (its traceback goes to stderr).
IMPORT_CHECK='import importlib, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as error:
        traceback.print_exc()
        print(f"{name}: {type(error).__name__}: {(str(error).splitlines() or [chr(63)])[0]}")
        sys.exit(1)'
# Transformer Engine first, where the wheel folder brought it: loading (and, on the GPU, running) it
# fails in one line that names what is missing -- a library, a package, the GPU's kernels --, and the
# check stops there: no fall-back to local layers. The traceback goes to a log beside the report.
TE_CHECK='import re, sys, traceback
gpu, log = sys.argv[1] == "1", sys.argv[2]
def missing(error):
    text = str(error)
    first = f"{type(error).__name__}: {(text.strip().splitlines() or [chr(63)])[0]}"
    library = re.search(r"(lib[\w.+-]*?\.so[\w.]*): cannot open shared object file", text)
    if library:
        return f"the library {library[1]} is not on the library path ({first}); LD_LIBRARY_PATH, CUDNN_PATH and NVRTC_PATH name where it is"
    named = re.search(r"\b(\w+) shared object not found", text)
    if named:
        return f"{named[1]} is not found ({first}): TE looks in {named[1].upper()}_PATH, CUDA_HOME, /usr/local/cuda and its nvidia/ packages"
    if isinstance(error, ModuleNotFoundError):
        return f"the Python package {error.name} is missing ({first}): remake the wheel folder with tools/te_wheels.py"
    if "no kernel image" in text:
        return f"the core library has no kernels for this GPU ({first}): remake the wheel folder with --arch for it"
    return first
stage = "import transformer_engine.pytorch"
try:
    import torch
    import transformer_engine.pytorch as te
    stage = "import megatron.core.extensions.transformer_engine"
    import megatron.core.extensions.transformer_engine  # noqa: F401
    if gpu:
        stage = "a bf16 te.Linear forward and backward on the GPU"
        layer = te.Linear(256, 256).cuda().bfloat16()
        layer(torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()
        torch.cuda.synchronize()
except BaseException as error:
    with open(log, "a") as file:
        traceback.print_exc(file=file)
    print(f"Transformer Engine does not load ({stage}): {missing(error)} [traceback: {log}]")
    sys.exit(1)
from importlib import metadata
print("Transformer Engine", metadata.version("transformer-engine"), "loads" + (" and runs a bf16 te.Linear on the GPU" if gpu else ""))'
te_check() {  # $1: 1 to run a layer on the GPU too; stops the check, in one line, when TE does not load
    local status=0 out log
    if [[ $LEDGER == 1 ]]; then log=$OUT/te_load.log; else log=$(mktemp -t te_load.XXXXXX); fi
    if [[ $1 == 1 ]]; then
        say "+ $(quote "$PY" -c "import transformer_engine.pytorch as te, torch; l = te.Linear(256, 256).cuda().bfloat16(); l(torch.randn(8, 256, device='cuda', dtype=torch.bfloat16)).sum().backward()")"
    else
        say "+ $(quote "$PY" -c "import transformer_engine.pytorch, megatron.core.extensions.transformer_engine")"
    fi
    [[ $DRY_RUN == 1 ]] && return 0
    out=$(bounded "$PY" -c "$TE_CHECK" "$1" "$log" 2>>"$log") || status=$?
    if timed_out "$status"; then
        STOP_STATUS=1 stop "loading Transformer Engine ran out of time (TIME_LIMIT=${TIME_LIMIT}s)"
    elif [[ $status != 0 ]]; then
        stop "$(tail -n 1 <<<"$out"); no fall-back to local layers: fix that, or run without the TE wheelhouse (WHEELS=../gpu_wheels)"
    fi
    say "$(tail -n 1 <<<"$out")"
}
if [[ -n $TE_VERSION ]]; then
    STAGE="loading Transformer Engine"
    te_check 0
    STAGE="the import check"
fi
IMPORT_LINE=$(IFS=,; echo "${IMPORTS[*]}")
say "+ $(quote "$PY" -c "import ${IMPORT_LINE//,/, }")"
if [[ $DRY_RUN == 0 ]]; then
    IMPORT_STATUS=0
    IMPORT_OUT=$(bounded "$PY" -c "$IMPORT_CHECK" "${IMPORTS[@]}") || IMPORT_STATUS=$?
    if timed_out "$IMPORT_STATUS"; then
        STOP_STATUS=1 stop "the import check ran out of time: set-up must end by ${DEADLINE}s of TIME_LIMIT=${TIME_LIMIT}s; raise TIME_LIMIT"
    elif [[ $IMPORT_STATUS != 0 ]]; then
        say "(the traceback above is $PY's)"
        stop "import check failed: $(tail -n 1 <<<"$IMPORT_OUT")"
    fi
fi
if [[ $MODE == setup ]]; then
    step "collecting the GPU suite" "$PY" -m pytest --collect-only -q -m gpu tests/gpu -p no:cacheprovider \
        || stop "collecting the GPU suite failed (pytest's message is above)"
    say "set-up complete ($PY); the check itself: tools/gpu_check.sh"
    exit 0
fi

# ---- 4. what this node is
STAGE="the environment probe"
run mkdir -p "$OUT"
say "+ $PY - $OUT  # environment.json: device, driver, CUDA, torch, megatron-core, TE, fused kernels"
if [[ $DRY_RUN == 0 ]]; then
    PROBE_STATUS=0
    bounded "$PY" - "$OUT" <<'PYEOF' || PROBE_STATUS=$?
import datetime, importlib, json, platform, sys
import torch
from epas_megatron.runtime.accelerator import detect
from epas_megatron.model.fusions import KernelAvailability, describe, fusion_settings, transformer_engine_importable

def version(name):
    try:
        return getattr(importlib.import_module(name), "__version__", "installed")
    except Exception as error:
        return f"not available ({type(error).__name__})"

facts = detect()
te = transformer_engine_importable()
env = {
    "date": datetime.date.today().isoformat(),
    "device": torch.cuda.get_device_name(), "device_count": torch.cuda.device_count(),
    "capability": ".".join(map(str, torch.cuda.get_device_capability())),
    "driver": facts.driver_version or "unknown", "cuda": torch.version.cuda, "torch": torch.__version__,
    "python": platform.python_version(), "megatron_core": version("megatron.core"),
    "transformer_engine": f"yes ({version('transformer_engine')})" if te else "no",
    "triton": version("triton"), "apex": version("apex"), "flash_attn": version("flash_attn"),
    "fusions": describe(fusion_settings(KernelAvailability.detect())),
}
json.dump(env, open(f"{sys.argv[1]}/environment.json", "w"), indent=1)
for key, value in env.items():
    print(f"{key}: {value}")
PYEOF
    if timed_out "$PROBE_STATUS"; then STOP_STATUS=1 stop "the environment probe ran out of time (TIME_LIMIT=${TIME_LIMIT}s)"; fi
    [[ $PROBE_STATUS == 0 ]] || stop "the environment probe failed (exit $PROBE_STATUS; its traceback is above)"
fi
if [[ -n $TE_VERSION ]]; then  # TE's own smoke test: a layer forward and backward on this GPU
    STAGE="running Transformer Engine on the GPU"
    te_check 1
fi

# ---- 5. the GPU suite, within what the time limit leaves (stopped with SIGINT: results so far are kept)
# Its limit leaves, before DEADLINE, its own kill-after grace and the benchmark's whole share.
STAGE="the GPU suite"
SUITE_START=$SECONDS
SUITE_LIMIT=$(( DEADLINE - SUITE_START - SUITE_KILL_AFTER - BENCH_SHARE ))
if (( SUITE_LIMIT < 1 )); then
    STOP_STATUS=1 stop "set-up took ${SECONDS}s: no time is left for the GPU suite within TIME_LIMIT=${TIME_LIMIT}s (the benchmark keeps ${BENCH_SHARE}s, the report ${REPORT_RESERVE}s): raise TIME_LIMIT or set BENCH=0"
fi
SUITE=(timeout --signal=INT --kill-after="$SUITE_KILL_AFTER" "$SUITE_LIMIT" "$PY" -m pytest -m gpu tests/gpu -v -rA -p no:cacheprovider
       --timeout "$TEST_TIMEOUT" --junitxml "$OUT/gpu_suite.xml")
say "+ $(quote "${SUITE[@]}") 2>&1 | tee $OUT/gpu_suite.log"
if [[ $DRY_RUN == 0 ]]; then
    set +e; "${SUITE[@]}" 2>&1 | tee "$OUT/gpu_suite.log"; echo "${PIPESTATUS[0]}" >"$OUT/gpu_suite.status"; set -e
fi

# ---- 6. a short benchmark at the 125m shape, seq 2048, within what is left before DEADLINE
STAGE="the benchmark"
if [[ $BENCH == 1 ]]; then
    BENCH_LIMIT=$(( DEADLINE - SECONDS - BENCH_KILL_AFTER ))
    (( BENCH_LIMIT <= BENCH_TIMEOUT )) || BENCH_LIMIT=$BENCH_TIMEOUT
    BENCH_CMD=(timeout --signal=INT --kill-after="$BENCH_KILL_AFTER" "$BENCH_LIMIT" "$PY" -m epas_megatron.bench.cli train --preset 125m
               --seq-length 2048 --micro-batch-size 4 --iters "$BENCH_ITERS" --blocks 4 --warmup 3)
    say "+ $(quote "${BENCH_CMD[@]}") 2>&1 | tee $OUT/bench.log"
    if [[ $DRY_RUN == 0 ]] && (( BENCH_LIMIT < 1 )); then
        echo "not run (the time limit was spent)" >"$OUT/bench.status"
    elif [[ $DRY_RUN == 0 ]]; then
        set +e; "${BENCH_CMD[@]}" 2>&1 | tee "$OUT/bench.log"; echo "${PIPESTATUS[0]}" >"$OUT/bench.status"; set -e
    fi
elif [[ $DRY_RUN == 0 ]]; then
    echo skipped >"$OUT/bench.status"
fi

# ---- 7. the report and the ledger row
STAGE="the report"
say "+ tools/gpu_check.sh --report $OUT"
if [[ $DRY_RUN == 1 ]]; then
    say "time limit: ${TIME_LIMIT}s in all (TIME_LIMIT), the worst case included; per test ${TEST_TIMEOUT}s (TEST_TIMEOUT); benchmark ${BENCH_TIMEOUT}s (BENCH_TIMEOUT)"
    say "time budget: set-up steps end by ${DEADLINE}s; from ${SUITE_START}s (set-up so far), the suite ${SUITE_LIMIT}s +" \
        "${SUITE_KILL_AFTER}s kill-after, the benchmark $(( BENCH_SHARE ? BENCH_TIMEOUT : 0 ))s +" \
        "$(( BENCH_SHARE ? BENCH_KILL_AFTER : 0 ))s kill-after, the report ${REPORT_RESERVE}s:" \
        "$(( SUITE_START + SUITE_LIMIT + SUITE_KILL_AFTER + BENCH_SHARE + REPORT_RESERVE ))s at most"
    exit 0
fi
say "gpu_check.sh took ${SECONDS}s"
REPORTED=1
report_within $(( TIME_LIMIT - SECONDS - 4 > 1 ? TIME_LIMIT - SECONDS - 4 : 1 ))
