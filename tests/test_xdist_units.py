"""conftest.py's units of work under ``pytest -n 2`` (the README's test command), on planted tests
in a pytest of its own: every test of a file runs on one worker, the Slurm files together on one
worker and before anything else there; a ``slurm`` test outside those files stops the run."""

import os
import subprocess
import sys
from collections import defaultdict

from epas_testing import REPO

PLANTED_CONFTEST = f"""
import importlib.util

_spec = importlib.util.spec_from_file_location("epas_suite_conftest", {str(REPO / "tests" / "conftest.py")!r})
_suite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_suite)
pytest_collection_modifyitems = _suite.pytest_collection_modifyitems
pytest_xdist_make_scheduler = _suite.pytest_xdist_make_scheduler
pytest_runtest_setup = _suite.pytest_runtest_setup
"""

RECORDING_TEST = """
import os
import pytest
{mark}

@pytest.mark.parametrize("i", range({count}))
def test_records_its_worker(i, request):
    with open(os.environ["EPAS_WORKER_LOG"], "a") as f:
        f.write(f"{{os.environ.get('PYTEST_XDIST_WORKER', 'main')}} {{request.node.nodeid}}\\n")
"""

FILES = {  # planted file -> number of tests; the Slurm ones last in collection order
    "tests/a/test_one.py": 6,
    "tests/a/test_two.py": 5,
    "tests/b/test_three.py": 7,
    "tests/launch/test_slurm_pretrain.py": 3,
    "tests/launch/test_slurm_sweep.py": 2,
}


def _plant(tmp_path, files, slurm_outside=False):
    (tmp_path / "conftest.py").write_text(PLANTED_CONFTEST)
    for name, count in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        slurm = "/test_slurm_" in name or (slurm_outside and name.endswith("test_three.py"))
        path.write_text(RECORDING_TEST.format(mark="pytestmark = pytest.mark.slurm" if slurm else "", count=count))


def _pytest(tmp_path, *args):
    # The inner run is its own: no xdist variables of an outer run under -n (they would make the
    # planted tests see a worker that does not exist, or, alone, miss one).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["EPAS_WORKER_LOG"] = str(tmp_path / "workers.log")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir",
                           str(tmp_path), "-o", "markers=slurm: planted", *args, "tests"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_takes_whole_files_and_the_slurm_files_first(tmp_path):
    _plant(tmp_path, FILES)
    proc = _pytest(tmp_path, "-n", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split(" ", 1) for line in (tmp_path / "workers.log").read_text().splitlines()]
    assert len(lines) == sum(FILES.values())
    workers_of_file, order = defaultdict(set), defaultdict(list)
    for worker, nodeid in lines:
        path = nodeid.split("::")[0]
        workers_of_file[path].add(worker)
        order[worker].append(path)
    assert all(len(workers) == 1 for workers in workers_of_file.values()), dict(workers_of_file)
    slurm_files = [name for name in FILES if "/test_slurm_" in name]
    (slurm_worker,) = workers_of_file[slurm_files[0]]
    assert workers_of_file[slurm_files[1]] == {slurm_worker}
    slurm_tests = sum(FILES[name] for name in slurm_files)
    assert set(order[slurm_worker][:slurm_tests]) == set(slurm_files)  # first on their worker
    assert len(order) == 2  # both workers had work


def test_without_workers_the_slurm_files_still_come_first(tmp_path):
    _plant(tmp_path, FILES)
    proc = _pytest(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    paths = [line.split(" ", 1)[1].split("::")[0] for line in (tmp_path / "workers.log").read_text().splitlines()]
    slurm_tests = sum(count for name, count in FILES.items() if "/test_slurm_" in name)
    assert all("/test_slurm_" in path for path in paths[:slurm_tests])
    assert paths[slurm_tests:] == [name for name in FILES if "/test_slurm_" not in name for _ in range(FILES[name])]


def test_a_slurm_test_outside_the_slurm_files_fails(tmp_path):
    _plant(tmp_path, FILES, slurm_outside=True)
    proc = _pytest(tmp_path, "-n", "2", "-rE")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    planted = FILES["tests/b/test_three.py"]
    assert f"{sum(FILES.values()) - planted} passed, {planted} errors" in out  # each fails at set-up
    assert "slurm tests must live in tests/launch/test_slurm_*.py" in out and "move tests/b/test_three.py::" in out
