#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh needs on a bare, offline GPU node -- and nothing else.
# Run it on any machine with PyPI access (any OS and Python with pip); the wheels are for the node:
# Linux x86-64, CPython 3.12.
#
#   tools/gpu_wheels.sh ../gpu_wheels
#
# then copy the checkout and the folder side by side to the node and run there, in one command:
#
#   cd epas-megatron && tools/gpu_check.sh        # finds ../gpu_wheels; or WHEELS=/path/to/it
#
# What it downloads: tools/gpu_check.sh --requirements (megatron-core 0.19.x, numpy, packaging,
# pyyaml, sentencepiece, psutil, pytest, pytest-timeout, tensorboard) and, following each wheel's own
# requirements for that platform, their dependencies (pytest's iniconfig, pluggy, pygments;
# TensorBoard's grpcio, protobuf, pillow, werkzeug, markdown, absl-py, tensorboard-data-server:
# about 42 MiB in all, 20 of them TensorBoard's, in November 2026). Never
# torch, nor what a CUDA torch brings with it (triton, nvidia-*, cuda-*, sympy, jinja2, ...): the
# node's own are used. Each wheel is fetched with pip download --no-deps --only-binary=:all: for the
# node's platform; the closure is computed here from the wheels' metadata, so a requirement nobody
# listed cannot be missed. The folder gets MANIFEST.txt (each wheel, its size and sha256) and must
# stay under MAX_MIB (the script fails otherwise).
#
# Environment:
#   PYTHON     python with pip to run pip download (default: python3)
#   MAX_MIB    size limit of the folder in MiB (default 60)
#   PLATFORMS  manylinux tags pip may match, space-separated (default: manylinux_2_28 down to
#              manylinux_2_17 and their legacy aliases, x86_64)
#
# With Transformer Engine, use tools/te_wheels.py instead (its --help): it builds TE's torch extension
# for the node's torch, trims TE's core library to the node's GPU, and gathers with them what this
# script gathers, less what the node has (its package list, read on the node in one command), into
# one folder (../te_wheels, which tools/gpu_check.sh prefers) within the same 60 MiB.
#
# DIR must be new, empty, or a folder this script made before (it has MANIFEST.txt), from which
# wheels no longer needed (older versions, dropped requirements) are removed. Exit status 0 when the folder is complete and small
# enough; 1 when a download failed (the network or a requirement: pip's message says which) or the
# folder is too large; 2 for bad arguments.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case "${1:-}" in
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    ""|-*) echo "error: usage: tools/gpu_wheels.sh DIR (the folder to fill, e.g. ../gpu_wheels)" >&2; exit 2 ;;
esac
DIR=$1
PYTHON=${PYTHON:-python3}
MAX_MIB=${MAX_MIB:-60}
PLATFORMS=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_25_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64"}
[[ $MAX_MIB =~ ^[0-9]+$ ]] || { echo "error: MAX_MIB=$MAX_MIB is not a whole number of MiB" >&2; exit 2; }
"$PYTHON" -m pip --version >/dev/null 2>&1 || { echo "error: PYTHON=$PYTHON has no pip: set PYTHON to a python with pip" >&2; exit 2; }
if [[ -e "$DIR" && ! -d "$DIR" ]]; then echo "error: $DIR exists and is not a folder: choose another DIR" >&2; exit 2; fi
if [[ -d "$DIR" && ! -f "$DIR/MANIFEST.txt" && -n "$(ls -A "$DIR")" ]]; then
    echo "error: $DIR is not empty and was not made by gpu_wheels.sh (no MANIFEST.txt): choose a new or empty DIR" >&2; exit 2
fi
mkdir -p "$DIR"
mapfile -t REQUIREMENTS < <("$REPO/tools/gpu_check.sh" --requirements)

PIP_DOWNLOAD=("$PYTHON" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12
              --implementation cp)
for platform in $PLATFORMS; do PIP_DOWNLOAD+=(--platform "$platform"); done
PIP_DOWNLOAD+=(-d "$DIR")

"$PYTHON" - "$DIR" "$MAX_MIB" "${PIP_DOWNLOAD[@]}" -- "${REQUIREMENTS[@]}" <<'EOF'
import datetime, email.parser, hashlib, re, shlex, subprocess, sys, zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

folder, max_mib = Path(sys.argv[1]), int(sys.argv[2])
split = sys.argv.index("--", 3)
pip_download, top_level = sys.argv[3:split], sys.argv[split + 1:]

# The node: Linux x86-64, CPython 3.12 (markers of the wheels' requirements are evaluated for it).
NODE = {"implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix", "platform_machine": "x86_64",
        "platform_python_implementation": "CPython", "platform_release": "", "platform_system": "Linux", "platform_version": "",
        "python_full_version": "3.12.3", "python_version": "3.12", "sys_platform": "linux"}
# The node's own torch and what a CUDA torch wheel requires: never downloaded.
FROM_TORCH = {"torch", "triton", "filelock", "typing-extensions", "setuptools", "sympy", "mpmath", "networkx", "jinja2",
              "markupsafe", "fsspec"}


def from_torch(name: str) -> bool:
    return name in FROM_TORCH or name.startswith(("nvidia-", "cuda-"))


def wheels() -> dict:
    """{canonical name: [(version, path)]} of the wheels in the folder."""
    found = {}
    for path in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        found.setdefault(name, []).append((version, path))
    return found


def requires(path: Path, extras: set) -> list:
    """The wheel's requirements that apply on the node (with the requested extras)."""
    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        message = email.parser.Parser().parsestr(archive.read(meta).decode())
    result = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**NODE, "extra": extra}) for extra in {"", *extras}):
            req.marker = None
            result.append(req)
    return result


chosen, extras, queue, seen = {}, {}, [Requirement(spec) for spec in top_level], set()
while queue:
    print("+ " + shlex.join(pip_download + [str(r) for r in queue]), flush=True)
    proc = subprocess.run(pip_download + [str(r) for r in queue])
    if proc.returncode != 0:
        print(f"error: pip download failed for {', '.join(map(str, queue))} (its message is above): a network problem "
              f"(PyPI unreachable) or no wheel for Linux x86-64 / CPython 3.12 in that range", file=sys.stderr)
        sys.exit(1)
    available, new = wheels(), []
    for req in queue:
        name = canonicalize_name(req.name)
        fits = sorted((v, p) for v, p in available.get(name, []) if req.specifier.contains(v, prereleases=True))
        if not fits:
            print(f"error: no wheel of {req} in {folder} after the download", file=sys.stderr)
            sys.exit(1)
        chosen[name] = fits[-1]
        extras.setdefault(name, set()).update(req.extras)
    for req in queue:
        name = canonicalize_name(req.name)
        for dep in requires(chosen[name][1], extras[name]):
            dep_name = canonicalize_name(dep.name)
            if from_torch(dep_name):
                continue
            if dep_name in chosen:
                if not dep.specifier.contains(chosen[dep_name][0], prereleases=True):
                    print(f"error: {req.name} {chosen[name][0]} requires {dep}, but {dep_name} {chosen[dep_name][0]} "
                          f"was chosen for another requirement: narrow tools/gpu_check.sh's REQUIREMENTS", file=sys.stderr)
                    sys.exit(1)
            elif str(dep) not in seen:
                seen.add(str(dep))
                new.append(dep)
    queue = new

# Wheels a previous run left that are not needed now (older versions, dropped requirements).
keep = {path for _, path in chosen.values()}
for versions in wheels().values():
    for _, path in versions:
        if path not in keep:
            print(f"removing {path.name} (not needed)")
            path.unlink()

rows, total = [], 0
for name in sorted(chosen):
    version, path = chosen[name]
    size = path.stat().st_size
    total += size
    rows.append(f"{path.name}  {size / 2**20:.2f} MiB  ({size} bytes)  sha256={hashlib.sha256(path.read_bytes()).hexdigest()}")
manifest = [
    f"# tools/gpu_wheels.sh, {datetime.date.today().isoformat()}: the wheels tools/gpu_check.sh installs where a GPU node lacks them",
    "# platform: Linux x86-64, CPython 3.12 (" + " ".join(t for t in pip_download if t.startswith("manylinux")) + ")",
    "# requirements (tools/gpu_check.sh --requirements): " + " ".join(top_level),
    "# never here: torch and what a CUDA torch brings (triton, nvidia-*, cuda-*, " + ", ".join(sorted(FROM_TORCH - {"torch", "triton"})) + ")",
    *rows,
    f"total: {len(rows)} wheels, {total / 2**20:.1f} MiB (limit {max_mib} MiB)",
]
(folder / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
print("\n".join(manifest[4:]))
if total > max_mib * 2**20:
    print(f"error: the wheels come to {total / 2**20:.1f} MiB, over MAX_MIB={max_mib}: drop a requirement from "
          f"tools/gpu_check.sh's REQUIREMENTS or raise MAX_MIB", file=sys.stderr)
    sys.exit(1)
EOF
echo "wrote $DIR (MANIFEST.txt lists each wheel). Copy it beside the checkout on the GPU node (as ../gpu_wheels) and run there:"
echo "  cd epas-megatron && tools/gpu_check.sh"
