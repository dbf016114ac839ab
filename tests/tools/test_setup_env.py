"""tools/setup_env.sh keeps a venv's working CUDA torch (in the supported range) instead of
installing requirements.txt's pin; without one (every CPU machine) it installs exactly as before.

The venv's python is a wrapper around this one: ``-m pip`` calls are recorded (with the
requirement and constraint files they name), not run, and a sitecustomize makes torch report a
usable GPU, or another version, where a case needs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epas_testing import REPO

CUDA = "import torch\ntorch.cuda.is_available = lambda: True\n"
NO_CUDA = "import torch\ntorch.cuda.is_available = lambda: False\n"  # also on a GPU node


def setup_env(tmp_path: Path, sitecustomize: str) -> tuple[str, str]:
    """Run tools/setup_env.sh on a fake venv; returns (its stdout, the pip log)."""
    site, log = tmp_path / "site", tmp_path / "pip.log"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize)
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ]; then
  echo "PIP $*" >> {log}
  prev=
  for arg in "$@"; do
    if [ "$prev" = -r ] || [ "$prev" = -c ]; then echo "FILE $prev"; cat "$arg"; fi >> {log}
    prev=$arg
  done
  exit 0
fi
if [ "$1 $2" = "-m compileall" ]; then echo "COMPILEALL $*" >> {log}; exit 0; fi
case "$*" in *megatron.core*) echo "setup: (fake) done"; exit 0 ;; esac
PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    env = {**os.environ, "VENV": str(tmp_path / "venv"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "tools/setup_env.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert python.exists(), "the venv was kept"
    return proc.stdout, log.read_text()


def pip_calls(log: str) -> list[str]:
    return [line[len("PIP "):] for line in log.splitlines() if line.startswith("PIP ")]


@pytest.mark.parametrize("sitecustomize", [NO_CUDA, CUDA + "torch.__version__ = '2.5.1+cu124'\n"], ids=["no-cuda", "cuda-out-of-range"])
def test_requirements_with_the_pin_as_before(tmp_path, sitecustomize):
    stdout, log = setup_env(tmp_path, sitecustomize)
    calls = pip_calls(log)
    assert calls[0] == "-m pip install -q --disable-pip-version-check --no-compile -r requirements.txt"
    assert "torch==2.14.1" in log.split("FILE -r", 1)[1].splitlines()
    assert "FILE -c" not in log and "keeping" not in stdout
    assert calls[-1] == "-m pip install -q --disable-pip-version-check --no-compile --no-build-isolation deepspeed==0.19.8"
    # pip compiles nothing; the venv's site-packages is compiled once, after the last install, on every core
    site = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    assert log.splitlines()[-1] == f"COMPILEALL -m compileall -q -j 0 {site}"


def test_a_working_cuda_torch_in_range_is_kept(tmp_path):
    stdout, log = setup_env(tmp_path, CUDA)
    assert f"keeping this venv's torch {torch.__version__}" in stdout
    calls = pip_calls(log)
    assert "-r requirements.txt" not in calls[0] and " -r /" in calls[0] and " -c /" in calls[0]
    requirements, constraints = log.split("FILE -r\n", 1)[1].split("FILE -c\n", 1)
    assert "megatron-core>=0.19.2,<0.20" in requirements.splitlines()
    assert not [line for line in requirements.splitlines() if line.startswith("torch")]
    assert constraints.splitlines()[0] == f"torch=={torch.__version__}"
    assert " -c /" in calls[-1] and calls[-1].endswith("deepspeed==0.19.8")
