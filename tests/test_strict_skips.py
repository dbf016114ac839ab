"""tests/strict_skips.py on planted tests, in a pytest of its own: with EPAS_STRICT_SKIPS=1 a skip
fails (a GPU test's does not); without it, skips stay skips."""

import os
import subprocess
import sys

from epas_testing import REPO

PLANTED = """
import pytest

def test_optional_dependency_missing():
    pytest.importorskip("no_such_module_for_epas_tests")

@pytest.mark.skipif(True, reason="a skip mark")
def test_skip_mark():
    pass

@pytest.mark.gpu
def test_gpu():
    pytest.skip("no CUDA here")

def test_passes():
    pass
"""


def _pytest(tmp_path, strict: bool) -> str:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    env = {**os.environ, "EPAS_STRICT_SKIPS": "1" if strict else "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "strict_skips", "-p", "no:cacheprovider",
                           "-c", os.devnull, "-o", "markers=gpu: needs CUDA", str(tmp_path)],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO / "tests")}, capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


def test_strict_skips_fail_except_gpu_tests(tmp_path):
    out = _pytest(tmp_path, strict=True)
    # A skip in the test body fails the test; a skip mark (evaluated at set-up) is an error: both fail the run.
    assert "1 failed, 1 passed, 1 skipped, 1 error" in out, out
    assert "FAILED test_planted.py::test_optional_dependency_missing" in out and "ERROR test_planted.py::test_skip_mark" in out
    assert "SKIPPED [1] test_planted.py" in out and "no CUDA here" in out  # the GPU test
    assert "EPAS_STRICT_SKIPS=1 forbids" in out


def test_without_the_variable_skips_stay_skips(tmp_path):
    out = _pytest(tmp_path, strict=False)
    assert "1 passed, 3 skipped" in out, out
