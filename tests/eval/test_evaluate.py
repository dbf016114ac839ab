"""epas-eval: one checkpoint at several region lengths."""

import json

import pytest

from epas_megatron.evaluate import main


@pytest.fixture(scope="module")
def trained(tiny_epas_run):
    return tiny_epas_run  # tests/conftest.py: TINY_EPAS_ARGS


def evaluate(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    lines = [l for l in captured.out.splitlines() if l.startswith("EVAL ")]
    return code, (json.loads(lines[-1][5:]) if lines else None), captured


def test_regions_table_and_trained_region_matches_training_validation(trained, capsys):
    code, payload, captured = evaluate(capsys, "--load", str(trained.output_dir / "checkpoints"), "--regions", "0,1,max",
                                       "--eval-iters", "2")
    assert code == 0, captured.err
    assert payload["trained_region"] == 2
    assert [r["region"] for r in payload["results"]] == [0, 1, 2]
    assert [r["sharing_layers"] for r in payload["results"]] == [[], [3], [2, 3]]
    # The trained region, rebuilt from the checkpoint, reproduces the trainer's own validation loss.
    assert payload["results"][2]["lm_loss"] == pytest.approx(trained.summary["final_valid_lm_loss"], rel=1e-6)
    # Region 0 runs every layer with its own (frozen) Q/K: a different, finite loss.
    assert payload["results"][0]["lm_loss"] != payload["results"][2]["lm_loss"]
    assert "| region | sharing layers | val loss |" in captured.out


def test_region_larger_than_trained_is_an_error(trained, capsys):
    code, payload, captured = evaluate(capsys, "--load", str(trained.output_dir / "checkpoints"), "--regions", "0,3")
    assert code == 2 and payload is None
    assert "--regions: 3 is larger than the region this checkpoint was trained with (2 layers)" in captured.err
    code, payload, captured = evaluate(capsys, "--load", str(trained.output_dir / "checkpoints"), "--regions", "4")
    assert code == 2 and "at most 3" in captured.err


def test_untrained_regions_on_request(trained, capsys):
    code, payload, _ = evaluate(capsys, "--load", str(trained.output_dir / "checkpoints"), "--regions", "3",
                                "--allow-untrained-regions", "--eval-iters", "1")
    assert code == 0 and payload["results"][0]["sharing_layers"] == [1, 2, 3]
