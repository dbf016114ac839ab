"""--async-save: checkpoints written by a forked writer while training goes on. Training is
unchanged by it, a resume from an asynchronously written checkpoint is bit-identical to the
uninterrupted run (one process and PP=2), and a run killed (SIGKILL) while a save is in flight
leaves the previous checkpoint as the latest, whole and resumable."""

import json
import signal

import pytest

from epas_testing import TINY, run_trainer

# Switches at 3 ([3]) and 6 ([2, 3]); saves every 2 iterations.
ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "1", "--epas-target-layers", "2",
        "--epas-interval", "3", "--seed", "13", "--init-method-std", "0.1", "--save-interval", "2", "--keep-last", "0"]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    return run_trainer(ARGS, tmp_path_factory.mktemp("sync") / "run")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    return run_trainer([*ARGS, "--async-save"], tmp_path_factory.mktemp("async") / "run")


def test_async_saves_complete_and_leave_training_unchanged(sync_run, async_run):
    assert async_run.losses == sync_run.losses and async_run.grad_norms == sync_run.grad_norms
    root = async_run.output_dir / "checkpoints"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    for it in (2, 4, 6, 8):
        assert f"saving checkpoint {root / f'iter_{it:07d}'} in the background" in async_run.stdout
        assert f"saved checkpoint {root / f'iter_{it:07d}'}" in async_run.stdout
        assert json.loads((root / f"iter_{it:07d}" / "run_meta.json").read_text())["iteration"] == it


@pytest.mark.parametrize("iteration", [4, 6])
def test_resume_from_an_async_checkpoint_is_bit_identical(async_run, tmp_path, iteration):
    ckpt = async_run.output_dir / "checkpoints" / f"iter_{iteration:07d}"
    run = run_trainer([*ARGS, "--async-save", "--load", str(ckpt)], tmp_path / "run")
    assert run.losses == {k: v for k, v in async_run.losses.items() if k > iteration}
    assert run.grad_norms == {k: v for k, v in async_run.grad_norms.items() if k > iteration}


def test_kill_during_an_async_save_leaves_the_previous_checkpoint_latest(async_run, tmp_path):
    out = tmp_path / "run"
    killed = run_trainer([*ARGS, "--async-save"], out, env={"EPAS_TEST_KILL_DURING_ASYNC_SAVE": "6"}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    root = out / "checkpoints"
    assert "saving checkpoint" in killed.stdout and f"saved checkpoint {root / 'iter_0000004'}" in killed.stdout
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert not (root / "iter_0000006" / "run_meta.json").exists()
    resumed = run_trainer([*ARGS, "--async-save", "--load", str(root)], out)
    assert "resumed from" in resumed.stdout and "iteration 4" in resumed.stdout
    # (metrics.jsonl holds the killed run's records too: the resumed run's are the later ones)
    assert {k: v for k, v in resumed.losses.items() if k > 4} == {k: v for k, v in async_run.losses.items() if k > 4}
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    assert json.loads((root / "iter_0000006" / "run_meta.json").read_text())["iteration"] == 6


@pytest.mark.distributed
def test_async_saves_with_two_pipeline_stages_resume_bit_identically(tmp_path):
    args = [*ARGS, "--pp", "2", "--epas-rebalance", "on", "--async-save"]
    whole = run_trainer(args, tmp_path / "whole", nproc=2)
    assert (whole.output_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "8"
    resumed = run_trainer([*args, "--load", str(whole.output_dir / "checkpoints" / "iter_0000004")], tmp_path / "resumed", nproc=2)
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 4}
