"""Exact resume (bit-identical on CPU), resume before/after an EPAS switch, resharded resume."""

import json

import pytest

from epas_testing import TINY, assert_close, run_trainer

# Switches at iterations 3, 6 and 9 (regions [3], [2,3], [1,2,3]).
ARGS = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--epas-target-layers", "3", "--epas-interval", "3", "--seed", "3", "--init-method-std", "0.1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    # A checkpoint after every iteration, all kept.
    return run_trainer([*ARGS, "--save-interval", "1", "--keep-last", "0"], tmp_path_factory.mktemp("u") / "run")


def after(losses: dict, iteration: int) -> dict:
    return {k: v for k, v in losses.items() if k > iteration}


def test_uninterrupted_run_switches_and_checkpoints(uninterrupted):
    assert [s["iteration"] for s in uninterrupted.switches] == [3, 6, 9]
    ckpts = sorted(p.name for p in (uninterrupted.output_dir / "checkpoints").glob("iter_*"))
    assert ckpts == [f"iter_{i:07d}" for i in range(1, 13)]
    meta = json.loads((uninterrupted.output_dir / "checkpoints" / "iter_0000006" / "run_meta.json").read_text())
    assert meta["sharing_layers"] == [2, 3] and meta["iteration"] == 6


def test_stop_and_resume_is_bit_identical(uninterrupted, tmp_path):
    out = tmp_path / "run"
    first = run_trainer([*ARGS, "--exit-interval", "5"], out)
    assert first.summary["iterations"] == 5 and first.summary["exit_reason"] == "exit_interval"
    second = run_trainer([*ARGS, "--load", str(out / "checkpoints")], out)
    assert second.summary["iterations"] == 12
    resumed = {k: v for k, v in second.losses.items()}
    assert resumed == uninterrupted.losses  # bit-identical, including iterations 1-5 from the first part
    assert [s["iteration"] for s in second.switches] == [3, 6, 9]


@pytest.mark.parametrize("iteration", [5, 6], ids=["before_switch", "after_switch"])
def test_resume_around_a_switch_is_bit_identical(uninterrupted, tmp_path, iteration):
    ckpt = uninterrupted.output_dir / "checkpoints" / f"iter_{iteration:07d}"
    run = run_trainer([*ARGS, "--load", str(ckpt)], tmp_path / "run")
    assert run.losses == after(uninterrupted.losses, iteration)
    assert run.grad_norms == after(uninterrupted.grad_norms, iteration)
    expected_switches = [i for i in (3, 6, 9) if i > iteration]
    assert [s["iteration"] for s in run.switches] == expected_switches


@pytest.mark.distributed
def test_resharded_resume_tp1_to_tp2(uninterrupted, tmp_path):
    ckpt = uninterrupted.output_dir / "checkpoints" / "iter_0000006"
    run = run_trainer([*ARGS, "--load", str(ckpt), "--tp", "2"], tmp_path / "run", nproc=2)
    assert_close(run.losses, after(uninterrupted.losses, 6), 1e-5, "TP2 resume loss")
    assert_close(run.grad_norms, after(uninterrupted.grad_norms, 6), 1e-5, "TP2 resume grad norm")


def test_a_run_killed_during_an_in_memory_switch_resumes_bit_identically(uninterrupted, tmp_path):
    """SIGKILL in the middle of the second switch (iteration 6: the old model, DDP and optimizer
    gone, the new model filled, the optimizer state moving): nothing of the switch is on disk,
    the last checkpoint (iteration 5) is whole, and the run resumed from it matches the
    uninterrupted one bit for bit."""
    import signal
    from pathlib import Path

    out = tmp_path / "run"
    killed = run_trainer([*ARGS, "--save-interval", "1"], out, module="kill_in_switch", check=False,
                         env={"EPAS_TEST_KILL_IN_SWITCH": "2", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    second = run_trainer([*ARGS, "--save-interval", "1", "--load", str(out / "checkpoints")], out)
    assert second.summary["iterations"] == 12
    assert second.losses == uninterrupted.losses and second.grad_norms == uninterrupted.grad_norms
