"""A non-finite loss or gradient norm stops the run: an ``error:`` line naming the iteration and
what was not finite, exit status 3, no checkpoint of the bad state (saves in flight of earlier
iterations complete), and ``--load`` of the run's directory resumes from the last good one.
fp16 overflow skips are the loss scaler's business (tests/training/test_precision.py).
"""

import sys
from pathlib import Path

import torch

from epas_testing import TINY, run_trainer, train_in_process

ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--seed", "3", "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "2"]


def _epas_train() -> str:
    """The installed ``epas-train`` command beside this interpreter."""
    return str(Path(sys.executable).parent / "epas-train")


def test_a_learning_rate_that_blows_up_stops_the_command(tmp_path):
    """The reported run: --lr 1e5 went NaN at iteration 3, trained on, saved and exited 0.
    Now: the gradient norm of iteration 2 is NaN -> error, exit 3; the asynchronous save of
    iteration 1, still in flight, completes and stays the latest checkpoint."""
    out = tmp_path / "run"
    run = run_trainer([*TINY, "--train-iters", "6", "--lr", "1e5", "--min-lr", "1e5", "--lr-warmup-iters", "0",
                       "--save-interval", "1", "--async-save"], out, check=False, command=[_epas_train()])
    assert run.returncode == 3, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "iteration 2: the gradient norm is nan" in errors[0], run.stderr[-3000:]
    assert f"--load {out / 'checkpoints'}" in errors[0] and "Traceback" not in run.stderr
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == ["iter_0000001"]
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert run.summary is None  # no summary of a run that failed
    assert [m for m in run.metrics if m.get("kind") == "error"] == [
        {"kind": "error", "iteration": 2, "error": errors[0].split(": ", 2)[2].split(";")[0]}]


def test_a_nan_loss_stops_before_the_step_and_the_run_resumes_from_the_last_good_checkpoint(tmp_path, monkeypatch):
    """bf16: the model's loss turns NaN at iteration 3 (a poisoned weight); the run stops
    without updating or saving; a resume of the run's directory from iteration 2 equals the
    uninterrupted run bit for bit."""
    from epas_megatron.runtime.wrapping import unwrap_model
    from epas_megatron.training.trainer import Trainer

    args = [*ARGS, "--precision", "bf16", "--save-interval", "1"]
    whole = train_in_process(args, tmp_path / "whole")

    poisoned = {}
    train_step = Trainer._train_step

    def poisoning_step(trainer):
        if trainer.iteration == 2:  # before iteration 3's step
            weight = unwrap_model(trainer.model[0]).embedding.word_embeddings.weight
            poisoned["before"], poisoned["weight"] = weight.detach().clone(), weight
            with torch.no_grad():
                weight[:, 0] = float("nan")
        return train_step(trainer)

    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_train_step", poisoning_step)
        stopped = train_in_process(args, out)
    assert stopped.returncode == 3
    error = [line for line in stopped.stdout.splitlines() if line.startswith("error:")][0]
    assert "iteration 3: the loss is nan (the weights were not updated)" in error
    assert f"the last good checkpoint is iteration 2: resume with --load {out / 'checkpoints'}" in error
    # Not updated: apart from the poisoned column, the weights are those before the step.
    assert torch.equal(poisoned["weight"].detach()[:, 1:], poisoned["before"][:, 1:])
    assert sorted(p.name for p in (out / "checkpoints").glob("iter_*")) == ["iter_0000001", "iter_0000002"]

    resumed = train_in_process([*args, "--load", str(out / "checkpoints")], tmp_path / "resumed")
    assert resumed.returncode == 0
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 2}
