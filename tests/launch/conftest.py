"""Fixtures for the launch tests: a real two-node Slurm cluster (session-scoped) and helpers.

The cluster comes up once per session in a temporary directory (``local_slurm.py``); if this
machine cannot run it (not root, no apt to install Slurm), the tests that need it are skipped
with the reason, unless ``EPAS_REQUIRE_SLURM=1`` (then they fail: CI sets nothing and runs as
root, so they run there). Every Slurm test cancels the cluster's jobs when it ends, pass or fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_slurm import ClusterUnavailable, LocalSlurmCluster, ensure_slurm_installed  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running LocalSlurmCluster; SLURM_CONF points at it for the whole session."""
    cluster = None
    try:
        ensure_slurm_installed()
        cluster = LocalSlurmCluster().start()
    except ClusterUnavailable as e:
        if os.environ.get("EPAS_REQUIRE_SLURM") == "1":
            pytest.fail(f"Slurm test cluster unavailable (EPAS_REQUIRE_SLURM=1): {e}")
        pytest.skip(f"Slurm test cluster unavailable: {e}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


@pytest.fixture
def cluster(slurm_cluster):
    """The session cluster, with every job cancelled when the test ends."""
    yield slurm_cluster
    slurm_cluster.cancel_all()

