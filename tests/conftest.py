"""Session-wide setup: one data cache for every trainer run in the suite."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def epas_cache_dir(tmp_path_factory):
    """EPAS_CACHE_DIR for in-process and subprocess runs: the embedded corpus, its tokenizer and
    dataset indices are built once per session."""
    path = os.environ.get("EPAS_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("epas-cache"))
    os.environ["EPAS_CACHE_DIR"] = path
    return path
