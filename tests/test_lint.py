"""ruff over the repository's Python (epas_megatron/, kernels/, tests/, tools/, launch/) with pyproject.toml's
[tool.ruff] configuration and the version requirements.txt pins. ruff missing is a failure, not a
skip: it is a test dependency that tools/setup_env.sh installs."""

import importlib.util
import re
import subprocess
import sys

import pytest

from epas_testing import REPO

PATHS = ["epas_megatron", "kernels", "tests", "tools", "launch"]


def pinned_ruff() -> str:
    for line in (REPO / "requirements.txt").read_text().splitlines():
        match = re.match(r"\s*ruff==(\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError("requirements.txt does not pin ruff (ruff==X.Y.Z)")


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail(f"ruff is not installed in {sys.prefix}: run `bash tools/setup_env.sh` (it installs requirements.txt, "
                    f"which pins ruff=={pinned_ruff()}), or `{sys.executable} -m pip install ruff=={pinned_ruff()}`", pytrace=False)
    version = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"{version.stdout.strip()} (requirements.txt pins {pinned_ruff()}): `ruff check {' '.join(PATHS)}` found problems "
        f"(fix the safe ones with `{sys.executable} -m ruff check --fix {' '.join(PATHS)}`):\n{proc.stdout}{proc.stderr}")
