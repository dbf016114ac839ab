"""--eval-regions: validation of the weights in training at other sharing regions.

The references are independent of the in-memory path under test: a run without
--eval-regions (training must be bit-identical), and epas-eval on checkpoints saved at the
evaluation iterations (the dist-checkpoint load into a model built for the region, not the
plain state-dict copy the trainer uses).
"""

import json

import pytest

from epas_megatron.evaluate import main as epas_eval
from epas_testing import TINY, run_trainer

# Switches at 3 (region [3]) and 6 ([2, 3]); evaluations at 4 (region 1 in training) and 8 (2).
ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--epas-target-layers", "2", "--epas-interval", "3", "--eval-interval", "4", "--eval-iters", "2",
        "--init-method-std", "0.2", "--seed", "3", "--save-interval", "4", "--keep-last", "0"]
REGIONS = ["--eval-regions", "0,max,2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval_regions")
    plain = run_trainer(ARGS, base / "plain")
    with_regions = run_trainer([*ARGS, *REGIONS, "--tensorboard"], base / "regions")
    untrained = run_trainer([*ARGS, *REGIONS, "--eval-untrained-regions"], base / "untrained")
    return plain, with_regions, untrained


def valid_rows(run):
    return {(m["iteration"], m["region"]): m for m in run.metrics if m.get("kind") == "valid"}


def test_training_is_bit_identical_with_region_evaluation(runs):
    plain, with_regions, untrained = runs
    for run in (with_regions, untrained):
        assert run.losses == plain.losses
        assert run.grad_norms == plain.grad_norms
        assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    # The validation of the region in training is the one the plain run logs.
    plain_rows = valid_rows(plain)
    assert sorted(plain_rows) == [(4, 1), (8, 2)]
    for key, row in plain_rows.items():
        assert valid_rows(with_regions)[key]["lm_loss"] == row["lm_loss"] and row["in_training"]


def test_regions_follow_the_region_in_training(runs):
    _, with_regions, untrained = runs
    # At iteration 4 region 2 is larger than the region in training (1): skipped, and said so.
    assert sorted(valid_rows(with_regions)) == [(4, 0), (4, 1), (8, 0), (8, 2)]
    assert "region 2 is skipped until the region in training has grown to it (now 1)" in with_regions.stdout
    assert sorted(valid_rows(untrained)) == [(4, 0), (4, 1), (4, 2), (8, 0), (8, 2)]
    rows = valid_rows(with_regions)
    assert rows[(8, 0)]["sharing_layers"] == [] and rows[(8, 2)]["sharing_layers"] == [2, 3]
    assert [rows[k]["in_training"] for k in sorted(rows)] == [False, True, False, True]
    assert rows[(8, 0)]["lm_loss"] != rows[(8, 2)]["lm_loss"]
    assert rows[(4, 0)]["train_time_s"] < rows[(8, 0)]["train_time_s"]
    summary = with_regions.summary
    assert summary["final_valid_lm_loss"] == rows[(8, 2)]["lm_loss"]
    assert summary["final_valid_lm_loss_by_region"] == {"0": rows[(8, 0)]["lm_loss"], "2": rows[(8, 2)]["lm_loss"]}


def checkpoint_eval(capsys, checkpoint, region):
    code = epas_eval(["--load", str(checkpoint), "--regions", str(region), "--eval-iters", "2", "--allow-untrained-regions"])
    out = capsys.readouterr()
    assert code == 0, out.err
    line = [l for l in out.out.splitlines() if l.startswith("EVAL ")][-1]
    return json.loads(line[5:])["results"][0]["lm_loss"]


def test_region_losses_equal_epas_eval_of_the_saved_checkpoints(runs, capsys):
    """Every (iteration, region) loss equals epas-eval's on the checkpoint of that iteration,
    including region 2 at iteration 4, where layer 2 still computes in training and shares here."""
    _, _, untrained = runs
    for (iteration, region), row in valid_rows(untrained).items():
        checkpoint = untrained.output_dir / "checkpoints" / f"iter_{iteration:07d}"
        expected = checkpoint_eval(capsys, checkpoint, region)
        assert row["lm_loss"] == pytest.approx(expected, rel=1e-6), (iteration, region)


def test_tensorboard_has_one_series_per_region(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, with_regions, _ = runs
    events = EventAccumulator(str(with_regions.output_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"valid/lm_loss", "valid/region_0/lm_loss", "valid/region_1/lm_loss", "valid/region_2/lm_loss"} <= tags
    assert [e.step for e in events.Scalars("valid/region_0/lm_loss")] == [4, 8]
    assert [e.value for e in events.Scalars("valid/lm_loss")] == pytest.approx(
        [valid_rows(with_regions)[(4, 1)]["lm_loss"], valid_rows(with_regions)[(8, 2)]["lm_loss"]])


def test_evaluating_another_region_leaves_every_rng_state_as_it_was(tmp_path):
    """Building the region's modules runs Megatron's initialisation, which draws random numbers;
    the trainer's random state after the evaluation must be the one before it."""
    import random

    import torch

    from megatron.core import tensor_parallel

    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    trainer = Trainer(resolve_run(parse_config([*ARGS, *REGIONS, "--output-dir", str(tmp_path / "run")]), world_size=1))
    trainer.setup()
    try:
        trainer.apply_switch((2, 3))
        state = lambda: (random.getstate(), torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())
        before = state()
        loss = trainer.evaluate(0)
        after = state()
        assert before[0] == after[0] and torch.equal(before[1], after[1])
        assert before[2].keys() == after[2].keys() and all(torch.equal(before[2][k], after[2][k]) for k in before[2])
        assert loss > 0
    finally:
        trainer.close()
