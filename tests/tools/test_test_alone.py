"""tools/test_alone.py: the audit that runs test files and single tests outside CI's configuration."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("epas_test_alone", REPO / "tools" / "test_alone.py")
alone = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = alone
spec.loader.exec_module(alone)


def test_the_files_are_every_test_file_but_the_gpu_folders():
    files = alone.test_files()
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    assert set(files) == {f for f in on_disk if not f.startswith("tests/gpu/")}
    assert "tests/test_xdist_units.py" in files and files == sorted(files)


def test_a_sample_is_seeded_and_without_repeats():
    ids = [f"tests/test_x.py::test_{i}" for i in range(50)]
    first = alone.sample(ids, 10, seed=3)
    assert first == alone.sample(ids, 10, seed=3) and len(set(first)) == 10 and set(first) <= set(ids)
    assert first != alone.sample(ids, 10, seed=4)
    assert alone.sample(ids, 0, seed=3) == ids and alone.sample(ids, 99, seed=3) == ids


def test_a_test_that_leans_on_the_runner_fails_alone_and_its_output_is_kept(tmp_path, monkeypatch):
    # Passes only inside an xdist worker (the defect this audit is for); alone it must fail, even
    # when this test itself runs in a worker (set here as xdist sets it).
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    planted = tmp_path / "test_planted.py"
    planted.write_text("import os\n\ndef test_needs_a_worker():\n    assert os.environ.get('PYTEST_XDIST_WORKER')\n\n"
                       "def test_fine():\n    assert 1 + 1 == 2\n")
    logs = tmp_path / "logs"
    target, status, _ = alone.run_one(f"{planted}::test_needs_a_worker", logs)
    assert status == 1 and target.endswith("test_needs_a_worker")
    (log,) = logs.iterdir()
    assert "test_needs_a_worker" in log.read_text()
    assert alone.run_one(f"{planted}::test_fine", tmp_path / "none")[1] == 0 and not (tmp_path / "none").exists()


def test_bad_jobs_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        alone.main(["files", "--jobs", "0"])
    assert exit_.value.code == 2 and "--jobs must be >= 1" in capsys.readouterr().err
