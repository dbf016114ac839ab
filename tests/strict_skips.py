"""A pytest plugin: with ``EPAS_STRICT_SKIPS=1`` (``.ci/run`` sets it) a skipped test fails
instead, except a GPU test (marker ``gpu``) -- a missing optional dependency (DeepSpeed, Triton,
lm-eval, a Slurm cluster) must not turn an independent check into a silent skip with CI green.
Loaded by ``tests/conftest.py``; ``tests/test_strict_skips.py`` runs it on planted tests."""

import os

import pytest

STRICT_SKIPS = "EPAS_STRICT_SKIPS"
"""The environment variable that turns skips into failures."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or os.environ.get(STRICT_SKIPS) != "1" or item.get_closest_marker("gpu"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped, which {STRICT_SKIPS}=1 forbids (only GPU tests may skip, on a machine without CUDA): "
                       f"{reason}; install what it needs (bash tools/setup_env.sh) or run without {STRICT_SKIPS}")
