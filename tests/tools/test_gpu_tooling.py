"""tools/gpu_check.sh and tools/gpu_wheels.sh on this CPU machine: the plan (--dry-run) and its
time budget, the ledger row from a run's outputs (--report) and from a run that stops early (a node
whose torch is told it has a GPU: tests/tools/fake_gpu), the wheel folder for Linux x86-64 /
CPython 3.12 (downloaded from PyPI once per module; skipped only when PyPI is unreachable), and that
folder installing, with no index, into a bare node -- a Python whose only packages are a CUDA torch
and what torch requires (this venv's, linked), as on the GPU nodes this tooling serves -- and into
an externally managed system python (PEP 668) with no venv support."""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from epas_testing import REPO

GPU_CHECK = REPO / "tools" / "gpu_check.sh"
GPU_WHEELS = REPO / "tools" / "gpu_wheels.sh"
NODE_TAGS = set(cpython_tags((3, 12), platforms=[f"manylinux_2_{n}_x86_64" for n in range(5, 29)]
                             + ["manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]))
NODE_TAGS |= set(compatible_tags((3, 12), "cp312", platforms=["manylinux_2_28_x86_64", "manylinux2014_x86_64"]))


def sh(script, *args, env=None, timeout=300, drop=()):
    full_env = {k: v for k, v in os.environ.items() if k not in drop}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(["bash", str(script), *map(str, args)], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def plan_lines(stdout):
    return [line[2:] for line in stdout.splitlines() if line.startswith("+ ")]


# ------------------------------------------------------------------------- the plan
def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path):
    (tmp_path / "wheels").mkdir()
    env = {"PYTHON": sys.executable, "WHEELS": str(tmp_path / "wheels"), "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out")}
    proc = sh(GPU_CHECK, "--dry-run", env=env)
    assert proc.returncode == 0, proc.stderr
    plan = "\n".join(plan_lines(proc.stdout))
    # this python has pip: the venv uses it through the link (no ensurepip needed)
    assert f"{sys.executable} -m venv --without-pip {tmp_path / 'venv'}" in plan
    assert f"{tmp_path / 'venv'}/bin/python -m pytest -m gpu tests/gpu" in plan and "--timeout 240" in plan
    assert f"--junitxml {tmp_path / 'out'}/gpu_suite.xml" in plan
    assert "-m epas_megatron.bench.cli train --preset 125m --seq-length 2048" in plan
    assert f"tools/gpu_check.sh --report {tmp_path / 'out'}" in plan
    assert re.search(r"timeout --signal=INT --kill-after=30 \d+ ", plan)  # the suite's share of TIME_LIMIT
    assert not (tmp_path / "venv").exists() and not (tmp_path / "out").exists() and not os.listdir(tmp_path / "wheels")


def test_requirements_are_what_the_wheel_folder_brings_and_never_torch():
    proc = sh(GPU_CHECK, "--requirements")
    names = {canonicalize_name(Requirement(line).name) for line in proc.stdout.split()}
    assert {"megatron-core", "numpy", "pyyaml", "sentencepiece", "psutil", "pytest", "pytest-timeout"} <= names
    # a first real run on the node logs to TensorBoard (on by default; launch/configs/125m.yaml too)
    assert "tensorboard" in names
    assert not any(n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-")) for n in names)


@pytest.mark.parametrize("script, args, env, message", [
    (GPU_CHECK, ["--bogus"], {}, "error: unknown argument --bogus"),
    (GPU_CHECK, ["--dry-run"], {"TIME_LIMIT": "ten"}, "error: TIME_LIMIT=ten"),
    (GPU_CHECK, ["--report", "/nonexistent/out"], {}, "error: --report /nonexistent/out is not a directory"),
    (GPU_CHECK, ["--setup-only"], {"PYTHON": sys.executable, "WHEELS": "/nonexistent/wheels"},
     "error: WHEELS=/nonexistent/wheels is not a directory"),
    (GPU_WHEELS, [], {}, "error: usage: tools/gpu_wheels.sh DIR"),
    (GPU_WHEELS, ["/tmp"], {"PYTHON": sys.executable}, "was not made by gpu_wheels.sh"),
    (GPU_WHEELS, ["x"], {"MAX_MIB": "lots"}, "error: MAX_MIB=lots"),
    (GPU_CHECK, ["--dry-run"], {"TIME_LIMIT": "180", "BENCH_TIMEOUT": "120"}, "error: TIME_LIMIT=180 leaves the GPU suite no time"),
], ids=["unknown-flag", "time-limit", "report-dir", "wheels-dir", "no-dir", "foreign-dir", "max-mib", "no-time-for-the-suite"])
def test_bad_arguments_exit_2_naming_the_knob(script, args, env, message):
    proc = sh(script, *args, env=env)
    assert proc.returncode == 2 and message in proc.stderr, (proc.stdout, proc.stderr)


@pytest.mark.parametrize("time_limit, bench, bench_timeout", [(570, 1, 120), (600, 1, 200), (240, 1, 60), (120, 0, 120)],
                         ids=["default", "lender-limit", "short", "no-bench"])
def test_the_worst_case_fits_in_time_limit(tmp_path, time_limit, bench, bench_timeout):
    """The suite's and the benchmark's timeouts with their --kill-after grace, the set-up already
    spent when the suite's limit was set (bash's SECONDS, which the plan states, at most this dry
    run's wall time) and the 20 s kept for the report add up to TIME_LIMIT, not more (issue #33: the
    grace came on top, 420 + 30 + 120 + 15 s after set-up at the default 570) and not less."""
    env = {"PYTHON": sys.executable, "WHEELS": str(tmp_path), "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out"),
           "TIME_LIMIT": str(time_limit), "BENCH": str(bench), "BENCH_TIMEOUT": str(bench_timeout)}
    start = time.monotonic()
    proc = sh(GPU_CHECK, "--dry-run", env=env)
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    plan = "\n".join(plan_lines(proc.stdout))
    suite = re.search(r"^timeout --signal=INT --kill-after=(\d+) (\d+) \S+ -m pytest -m gpu tests/gpu ", plan, re.M)
    bench_run = re.search(r"^timeout --signal=INT --kill-after=(\d+) (\d+) \S+ -m epas_megatron.bench.cli train ", plan, re.M)
    (budget,) = [line for line in proc.stdout.splitlines() if line.startswith("time budget:")]
    set_up = int(re.search(r"from (\d+)s \(set-up so far\)", budget)[1])
    assert suite and set_up <= wall + 1, (plan, budget)  # SECONDS counts whole seconds of the clock
    worst = set_up + int(suite[1]) + int(suite[2]) + 20
    if bench:
        assert bench_run and int(bench_run[2]) == bench_timeout, plan
        worst += int(bench_run[1]) + int(bench_run[2])
    else:
        assert bench_run is None
    assert worst == time_limit, (worst, plan)
    assert int(re.search(r"(\d+)s at most$", budget)[1]) == time_limit, budget


# ------------------------------------------------------------------------- a node told it has a GPU
FAKE_GPU = """\
# gpu_check.sh's CPU tests: torch, once imported, says it has one H100 (nothing ever runs on it).
import importlib.abc, importlib.machinery, sys


def _one_gpu(torch):
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H100 80GB HBM3"


class _TorchWithAGpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _one_gpu(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TorchWithAGpu())
"""


@pytest.fixture
def fake_gpu_node(tmp_path):
    """(environment, planted-module folder) for gpu_check.sh on this venv's python as a GPU node's:
    a sitecustomize on PYTHONPATH tells torch it has a GPU, a fake nvidia-smi names it and the
    driver, pytest-timeout (which this venv lacks) has metadata there, and the test plants its
    module."""
    fake = tmp_path / "fake"
    (fake / "pytest_timeout-2.3.1.dist-info").mkdir(parents=True)
    (fake / "pytest_timeout-2.3.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: pytest-timeout\nVersion: 2.3.1\n")
    (fake / "sitecustomize.py").write_text(FAKE_GPU)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 570.86.15"\n')
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(fake), "PYTHON": sys.executable,
           "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path / "wheels")}
    (tmp_path / "wheels").mkdir()
    return env, fake


@pytest.mark.parametrize("failure", ["import", "plan"])
def test_a_check_that_stops_after_the_gpu_is_known_writes_the_ledger_row(fake_gpu_node, tmp_path, failure):
    """A stop after the node is known (issue #33: a failed import check left no row) writes the row,
    with the reason, to OUT/ledger_row.md and stdout; an earlier run's suite report is not counted."""
    env, fake = fake_gpu_node
    if failure == "import":
        (fake / "pytest_timeout.py").write_text('raise ImportError("planted: its plugin hooks do not load")\n')
        reason = "check stopped: import check failed: pytest_timeout: ImportError: planted: its plugin hooks do not load"
    else:  # a wheel for what is missing, but not a zip: the plan cannot read its requirements
        shutil.rmtree(fake / "pytest_timeout-2.3.1.dist-info")
        (tmp_path / "wheels" / "pytest_timeout-2.3.1-py3-none-any.whl").write_text("not a zip")
        reason = f"check stopped: could not plan the install with {tmp_path / 'venv'}/bin/python (its error is above)"
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_suite.xml").write_text(junit([("test_gpu_training::test_bf16_run_with_switches_learns", "passed", "")]))
    proc = sh(GPU_CHECK, env=env, drop=("CUDA_VISIBLE_DEVICES",))
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert f"error: {reason.removeprefix('check stopped: ')}" in proc.stderr
    row = (out / "ledger_row.md").read_text().strip()
    assert row in proc.stdout.splitlines()
    cells = ledger_cells(row)
    assert len(cells) == len(readme_ledger_columns())
    assert cells[1:5] == ["NVIDIA H100 80GB HBM3 x1 (driver 570.86.15)", f"{torch.__version__} (CUDA {torch.version.cuda})",
                          metadata.version("megatron-core"), "no"]
    assert cells[5] == f"{reason}; GPU suite not run"
    report = json.loads((out / "gpu_check.json").read_text())
    assert not report["ok"] and report["passed"] == [] and report["stopped"] == reason.removeprefix("check stopped: ")
    # --report prints the same row again
    again = sh(GPU_CHECK, "--report", out, env={"PYTHON": sys.executable})
    assert again.returncode == 1 and row in again.stdout.splitlines()


def test_a_set_up_step_that_hangs_is_stopped_within_time_limit(fake_gpu_node):
    """Set-up steps run under timeout too, their kill-after inside TIME_LIMIT: an import that ignores
    SIGTERM is killed, and the whole check ends by TIME_LIMIT, exit 1 (ran out of time)."""
    env, fake = fake_gpu_node
    (fake / "pytest_timeout.py").write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(100)\n")
    start = time.monotonic()
    env = {k: v for k, v in env.items() if k != "PATH"}  # set-up needs no GPU: no nvidia-smi either
    proc = sh(GPU_CHECK, "--setup-only", env={**env, "TIME_LIMIT": "40"}, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1 and "error: the import check ran out of time" in proc.stderr, (proc.stdout, proc.stderr)
    assert elapsed <= 40, elapsed


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU that torch can use: the fake nvidia-smi cannot make it unusable")
def test_a_node_whose_torch_cannot_use_its_gpus_stops_before_anything(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 570.86.15"\n')
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable, "VENV": str(tmp_path / "venv"),
           "OUT": str(tmp_path / "out")}
    proc = sh(GPU_CHECK, env=env, drop=("CUDA_VISIBLE_DEVICES",))
    assert proc.returncode == 2 and "error: this node has GPUs (nvidia-smi lists 1 GPU (NVIDIA H100 80GB HBM3))" in proc.stderr
    assert "NVIDIA driver 570.86.15" in proc.stderr and not (tmp_path / "venv").exists() and not (tmp_path / "out").exists()


def test_the_check_needs_the_nodes_own_torch(tmp_path):
    no_torch = getattr(sys, "_base_executable", sys.executable)  # the base interpreter of this venv
    if subprocess.run([no_torch, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip(f"{no_torch} has torch")
    proc = sh(GPU_CHECK, "--setup-only", env={"PYTHON": no_torch, "VENV": str(tmp_path / "venv")})
    assert proc.returncode == 2 and "cannot import torch" in proc.stderr and "never installs one" in proc.stderr
    assert not (tmp_path / "venv").exists()


# ------------------------------------------------------------------------- the ledger row
def junit(cases):
    body = []
    for name, outcome, message in cases:
        inner = {"passed": "", "failed": f'<failure message="{message}">trace</failure>',
                 "skipped": f'<skipped type="pytest.skip" message="{message}">x</skipped>'}[outcome]
        body.append(f'<testcase classname="tests.gpu.{name.split("::")[0]}" name="{name.split("::")[1]}" time="1.0">{inner}</testcase>')
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(body)}<testcase time="0.000" /></testsuite></testsuites>'


def run_dir(tmp_path, cases, suite_status="1", bench_status="0", log=""):
    out = tmp_path / "out"
    out.mkdir(parents=True)
    env = {"date": "2026-11-20", "device": "NVIDIA H100 80GB HBM3", "device_count": 1, "driver": "580.159.04", "cuda": "13.0",
           "torch": "2.11.0+cu130", "megatron_core": "0.19.2", "transformer_engine": "no"}
    (out / "environment.json").write_text(json.dumps(env))
    (out / "gpu_suite.xml").write_text(junit(cases))
    (out / "gpu_suite.status").write_text(suite_status + "\n")
    (out / "gpu_suite.log").write_text(log)
    record = {"preset": "125m", "seq_length": 2048, "precision": "bf16", "backend": "local", "ratio": 1.0712,
              "flop_limit_ratio": 1.0633, "baseline_tokens_per_s": 412345.6}
    (out / "bench.log").write_text("bench: ...\nBENCH " + json.dumps(record) + "\n")
    (out / "bench.status").write_text(bench_status + "\n")
    return out


def ledger_cells(row):
    assert row.startswith("| ") and row.endswith(" |"), row
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row)[1:-1]]


def readme_ledger_columns():
    header = next(line for line in (REPO / "docs" / "gpu-ledger.md").read_text().splitlines() if line.startswith("| date | device"))
    return ledger_cells(header)


def test_report_prints_a_ledger_row_with_counts_and_reasons(tmp_path):
    te = "Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)"
    cases = [("test_gpu_training::test_bf16_run_with_switches_learns", "passed", ""),
             ("test_gpu_bench::test_train_bench_record", "passed", ""),
             ("test_gpu_training::test_fp16_with_dynamic_loss_scaling_learns", "failed", "AssertionError: loss scale"),
             ("test_gpu_transformer_engine::test_te_layers_equal_local_layers[region0-qk]", "skipped", te),
             ("test_gpu_transformer_engine::test_te_run_switches_and_resumes", "skipped", te),
             ("test_gpu_bench::test_pipeline_bench_record", "skipped", "the pipeline benchmark needs 2 GPUs | PP=2")]
    out = run_dir(tmp_path, cases)
    proc = sh(GPU_CHECK, "--report", out, env={"PYTHON": sys.executable})
    assert proc.returncode == 1, proc.stderr  # a test failed
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| 2026-11-20")]
    cells = ledger_cells(row)
    assert len(cells) == len(readme_ledger_columns()) == 6  # date | device (driver) | torch | megatron-core | TE | result
    assert cells[:5] == ["2026-11-20", "NVIDIA H100 80GB HBM3 x1 (driver 580.159.04)", "2.11.0+cu130 (CUDA 13.0)", "0.19.2", "no"]
    result = cells[5]
    assert result.startswith("GPU suite: 2 passed, 1 failed, 3 skipped")
    assert f"{te} (x2)" in result and "the pipeline benchmark needs 2 GPUs \\| PP=2 (x1)" in result
    assert "failed: test_gpu_training::test_fp16_with_dynamic_loss_scaling_learns" in result
    assert "EPAS/baseline 1.071 (FLOP limit 1.063), baseline 412,346 tok/s" in result
    assert (out / "ledger_row.md").read_text().strip() == row
    report = json.loads((out / "gpu_check.json").read_text())
    assert len(report["passed"]) == 2 and not report["ok"]


def test_report_of_a_clean_run_exits_0_and_of_a_stopped_suite_names_the_test(tmp_path):
    passed = [("test_gpu_training::test_bf16_run_with_switches_learns", "passed", "")]
    clean = run_dir(tmp_path, passed, suite_status="0")
    proc = sh(GPU_CHECK, "--report", clean, env={"PYTHON": sys.executable})
    assert proc.returncode == 0 and "GPU suite: 1 passed, 0 failed, 0 skipped; bench train 125m" in proc.stdout, proc.stdout
    log = ("tests/gpu/test_gpu_training.py::test_bf16_run_with_switches_learns PASSED [ 20%]\n"
           "tests/gpu/test_gpu_training.py::test_fp16_with_dynamic_loss_scaling_learns \n"
           "!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!\n")
    stopped = run_dir(tmp_path / "stopped", passed, suite_status="124", bench_status="124", log=log)
    proc = sh(GPU_CHECK, "--report", stopped, env={"PYTHON": sys.executable})
    assert proc.returncode == 1
    assert "stopped at its time limit in tests/gpu/test_gpu_training.py::test_fp16_with_dynamic_loss_scaling_learns" in proc.stdout
    assert "bench stopped at its time limit" not in proc.stdout  # the record is there: it is reported instead


# ------------------------------------------------------------------------- the wheel folder (PyPI)
def index_unreachable() -> str | None:
    """Why pip's index cannot be reached from here, or None."""
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/megatron-core/"
    context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    try:
        urllib.request.urlopen(url, timeout=15, context=context).close()
    except (urllib.error.URLError, OSError) as error:
        return f"{url}: {error}"
    return None


@pytest.fixture(scope="module")
def wheel_folder(tmp_path_factory):
    problem = index_unreachable()
    if problem is not None:
        pytest.skip(f"PyPI is unreachable from this machine, so the wheel folder cannot be downloaded here ({problem})")
    folder = tmp_path_factory.mktemp("wheels") / "gpu_wheels"
    proc = sh(GPU_WHEELS, folder, env={"PYTHON": sys.executable}, timeout=600)
    assert proc.returncode == 0, f"gpu_wheels.sh failed with PyPI reachable:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return folder


def requirement_closure(*names: str) -> set[str]:
    """``names`` and, in this venv, what they require, recursively (canonical names)."""
    todo, done = list(names), set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in done:
            continue
        done.add(name)
        for line in metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return done


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = email.parser.Parser().parsestr(archive.read(meta).decode()).get_all("Requires-Dist") or []
    node = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    return [r for r in map(Requirement, lines) if r.marker is None or r.marker.evaluate(node)]


def test_wheel_folder_holds_exactly_what_the_check_needs_for_linux_cp312(wheel_folder):
    wheels = {parse_wheel_filename(p.name)[0]: p for p in wheel_folder.glob("*.whl")}
    for path in wheels.values():
        assert parse_wheel_filename(path.name)[3] & NODE_TAGS, f"{path.name} does not install on Linux x86-64 / CPython 3.12"
    assert not [n for n in wheels if n in ("torch", "triton") or n.startswith(("nvidia-", "cuda-"))]
    top_level = {canonicalize_name(Requirement(line).name) for line in sh(GPU_CHECK, "--requirements").stdout.split()}
    assert top_level <= set(wheels)
    # exactly: every wheel is a requirement of the check or of another wheel there ...
    needed = top_level | {canonicalize_name(r.name) for p in wheels.values() for r in wheel_requires(p)}
    assert set(wheels) <= needed, set(wheels) - needed
    # ... and every requirement of a wheel is there, or is the node's torch (and what it brings:
    # its requirements and theirs, e.g. werkzeug's markupsafe, which torch's jinja2 brings)
    torch_tree = requirement_closure("torch")
    for name, path in wheels.items():
        for req in wheel_requires(path):
            dep = canonicalize_name(req.name)
            assert dep in wheels or dep in torch_tree, f"{name} needs {req}, which is neither in the folder nor torch's"
    # the manifest lists each wheel with its size, under the limit
    manifest = (wheel_folder / "MANIFEST.txt").read_text()
    total = 0
    for path in wheels.values():
        (line,) = [l for l in manifest.splitlines() if l.startswith(path.name + " ")]
        assert f"({path.stat().st_size} bytes)" in line
        total += path.stat().st_size
    assert total <= 60 * 2**20 and f"total: {len(wheels)} wheels, {total / 2**20:.1f} MiB (limit 60 MiB)" in manifest


def test_wheel_folder_over_the_size_limit_fails(wheel_folder, tmp_path):
    """The same gathering, over MAX_MIB: pip download reads the wheels from the folder itself (no
    index: the fixture's run has shown that PyPI serves them), so the whole script runs offline."""
    copy = tmp_path / "gpu_wheels"
    shutil.copytree(wheel_folder, copy)
    offline = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(copy), "PIP_CONFIG_FILE": os.devnull}
    proc = sh(GPU_WHEELS, copy, env={"PYTHON": sys.executable, "MAX_MIB": "1", **offline}, drop=PIP_ENV, timeout=600)
    assert proc.returncode == 1 and "over MAX_MIB=1" in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------- offline, on a bare node
@pytest.fixture(scope="module")
def bare_node(tmp_path_factory):
    """A Python 3.12 whose only packages are this venv's torch and what it requires (linked)."""
    root = tmp_path_factory.mktemp("node")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    link_packages(site, "torch")
    probe = subprocess.run([python, "-c", "import torch, importlib.util as u; print(torch.__version__, u.find_spec('numpy') is None)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.split() == [torch_version(), "True"], probe.stderr[-2000:]
    return python


def link_packages(site: Path, *names: str) -> None:
    """Link this venv's ``names`` and everything they require into ``site`` (a node's own packages)."""
    for name in requirement_closure(*names):
        dist = metadata.distribution(name)
        location = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if (location / top).exists() and not (site / top).exists():
                (site / top).symlink_to(location / top)


def torch_version():
    import torch

    return torch.__version__


NO_PIP_CONFIG = {"PIP_CONFIG_FILE": os.devnull}
PIP_ENV = [k for k in os.environ if k.startswith("PIP_")]


def test_wheel_folder_installs_offline_on_a_bare_node(wheel_folder, bare_node, tmp_path):
    env = {**NO_PIP_CONFIG, "PYTHON": str(bare_node), "WHEELS": str(wheel_folder), "VENV": str(tmp_path / "venv"),
           "OUT": str(tmp_path / "out")}
    proc = sh(GPU_CHECK, "--setup-only", env=env, drop=PIP_ENV, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (install,) = [line for line in plan_lines(proc.stdout) if " -m pip " in line]
    assert "--isolated install" in install and "--no-index --no-deps" in install and str(wheel_folder / "megatron_core-0.19.") in install
    assert "tests collected" in proc.stdout and "set-up complete" in proc.stdout
    # the node's torch is used as it is: the check's venv holds what was missing, nothing of torch's
    # (after the install the script re-plans and stops unless nothing is left to install)
    site = next((tmp_path / "venv" / "lib").glob("python3.*/site-packages"))
    assert (site / "megatron" / "core").is_dir() and (site / "pytest_timeout.py").exists()
    assert not [p.name for p in site.iterdir() if p.name.startswith(("torch", "triton", "nvidia"))]
    # a first real run at the 125m config logs to TensorBoard (issue #33: tensorboard was not in the
    # folder): its logger writes an event file with what this node now has
    assert (site / "tensorboard").is_dir()
    script = ("import sys; from epas_megatron.config.cli import parse_config; from epas_megatron.metrics.logger import MetricsLogger\n"
              "config = parse_config(['--config', 'launch/configs/125m.yaml'])\n"
              "assert config.logging.tensorboard, '125m.yaml no longer logs to TensorBoard'\n"
              "log = MetricsLogger(sys.argv[1], enabled=True, tensorboard=config.logging.tensorboard)\n"
              "log.log({'iteration': 1, 'lm_loss': 2.5}, step=1); log.close()")
    run = subprocess.run([tmp_path / "venv" / "bin" / "python", "-c", script, tmp_path / "run"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**{k: v for k, v in os.environ.items() if k not in PIP_ENV}, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_a_wheel_folder_missing_a_dependency_fails_naming_it(wheel_folder, bare_node, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(wheel_folder, partial, ignore=shutil.ignore_patterns("pluggy-*"))
    env = {**NO_PIP_CONFIG, "PYTHON": str(bare_node), "WHEELS": str(partial), "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out")}
    proc = sh(GPU_CHECK, "--setup-only", env=env, drop=PIP_ENV, timeout=600)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert re.search(r"pluggy\S* \(for pytest", proc.stdout) and f"WHEELS={partial} lacks" in proc.stderr, (proc.stdout, proc.stderr)
    assert not list((tmp_path / "venv").glob("lib/python3.12/site-packages/pytest")), "nothing is installed from an incomplete folder"


# ------------------------------------------------------------------------- a system python (PEP 668)
def make_system_python(root: Path) -> Path:
    """A Debian/Ubuntu-like system python3.12 under ``root``: not a venv, its environment
    externally managed (an EXTERNALLY-MANAGED marker beside the stdlib, PEP 668), no ensurepip
    (python3.12-venv not installed), pip and the node's CUDA torch in its site-packages. A copy of
    this venv's base interpreter with its stdlib linked entry by entry (the marker is the copy's own)."""
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    stdlib, version = Path(sysconfig.get_path("stdlib")), f"python{sys.version_info.major}.{sys.version_info.minor}"
    lib = root / "system" / "lib" / version
    lib.mkdir(parents=True)
    (root / "system" / "bin").mkdir()
    shutil.copy2(base, root / "system" / "bin" / version)
    for shared in base.parent.parent.glob("lib/libpython*"):  # where the interpreter finds it relative to itself
        (root / "system" / "lib" / shared.name).symlink_to(shared)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "ensurepip", "EXTERNALLY-MANAGED"):
            (lib / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=this python is the system's (planted by test_gpu_tooling.py)\n")
    (lib / "site-packages").mkdir()
    link_packages(lib / "site-packages", "torch", "pip")
    return root / "system" / "bin" / version


@pytest.fixture(scope="module")
def system_python_recipe(tmp_path_factory):
    """:func:`make_system_python`, probed once per module: the copy is no venv, its stdlib is its
    own (where the marker is), and it imports the node's torch (each test then gets a fresh copy
    made the same way: the VENV=system test installs into its site-packages)."""
    python = make_system_python(tmp_path_factory.mktemp("system_probe"))
    script = "import sys, sysconfig, torch; print(sys.prefix == sys.base_prefix, sysconfig.get_path('stdlib'))"
    probe = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.split() == ["True", str(system_site(python).parent)], probe.stderr[-2000:]
    return make_system_python


@pytest.fixture
def system_python(tmp_path, system_python_recipe):
    """A fresh :func:`make_system_python` of this test's own."""
    return system_python_recipe(tmp_path)


def system_site(python: Path) -> Path:
    return python.parent.parent / "lib" / python.name / "site-packages"


def installed(site: Path) -> list[str]:
    """What is installed in ``site``: its entries but the bytecode cache (Python writes one there
    when it imports the node's packages and PYTHONDONTWRITEBYTECODE is unset, as in .ci/run)."""
    return sorted(p.name for p in site.iterdir() if p.name != "__pycache__")


def test_a_system_python_without_ensurepip_still_gets_its_venv(wheel_folder, system_python, tmp_path):
    """No python3.12-venv (no ensurepip): the default venv is made without pip and runs the node's
    pip; what was missing goes into it, nothing into the system's environment."""
    before = installed(system_site(system_python))
    env = {**NO_PIP_CONFIG, "PYTHON": str(system_python), "WHEELS": str(wheel_folder), "VENV": str(tmp_path / "venv"),
           "OUT": str(tmp_path / "out")}
    proc = sh(GPU_CHECK, "--setup-only", env=env, drop=PIP_ENV, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert f"{system_python} -m venv --without-pip {tmp_path / 'venv'}" in plan_lines(proc.stdout)
    site = next((tmp_path / "venv" / "lib").glob("python3.*/site-packages"))
    assert (site / "megatron" / "core").is_dir() and (site / "tensorboard").is_dir()
    assert installed(system_site(system_python)) == before


def test_venv_system_installs_into_an_externally_managed_python(wheel_folder, system_python, tmp_path):
    """VENV=system on a PEP 668 python: pip --isolated ignores PIP_BREAK_SYSTEM_PACKAGES (shown
    first, with this python's pip), so the check passes --break-system-packages itself and the
    install lands in the system's site-packages (issue #33: it failed there)."""
    a_wheel = next(wheel_folder.glob("iniconfig-*.whl"))
    refused = subprocess.run([system_python, "-m", "pip", "--isolated", "install", "--no-index", "--no-deps", a_wheel],
                             capture_output=True, text=True, timeout=300,
                             env={**{k: v for k, v in os.environ.items() if k not in PIP_ENV}, "PIP_BREAK_SYSTEM_PACKAGES": "1"})
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stdout + refused.stderr, refused
    env = {**NO_PIP_CONFIG, "PYTHON": str(system_python), "WHEELS": str(wheel_folder), "VENV": "system", "OUT": str(tmp_path / "out")}
    proc = sh(GPU_CHECK, "--setup-only", env=env, drop=PIP_ENV, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    (install,) = [line for line in plan_lines(proc.stdout) if " -m pip " in line]
    assert install.startswith(f"{system_python} -m pip --isolated install") and "--break-system-packages" in install
    site = system_site(system_python)
    assert (site / "megatron" / "core").is_dir() and (site / "tensorboard").is_dir() and "set-up complete" in proc.stdout
    assert not (tmp_path / "venv").exists()


def test_a_python_that_cannot_make_a_venv_stops_naming_venv_system(system_python, tmp_path):
    """Where '-m venv' itself fails (here: a venv module that does not load), the stop says to set
    VENV=system, and nothing is installed."""
    (tmp_path / "broken" / "venv").mkdir(parents=True)
    (tmp_path / "broken" / "venv" / "__init__.py").write_text('raise ImportError("planted: no venv module here")\n')
    env = {"PYTHON": str(system_python), "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path),
           "PYTHONPATH": str(tmp_path / "broken")}
    proc = sh(GPU_CHECK, "--setup-only", env=env, timeout=300)
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-3000:])
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert f"{system_python} -m venv {tmp_path / 'venv'} failed" in error and "set VENV=system" in error, error
    assert "--break-system-packages" in error and not (tmp_path / "venv" / "bin" / "python").exists()
