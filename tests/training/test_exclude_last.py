"""--epas-exclude-last end to end on one tiny run (one training run and one resume, to keep CI
time small): the schedule's switches in metrics.jsonl, a bit-identical resume from a mid-run
checkpoint, and the checkpoint's regions in epas-eval and the Generator (they end one layer
before the last, where training had them)."""

import json

import pytest

from epas_testing import TINY, run_trainer

# 4 layers, region ending at layer 2 (layer 3 always computes): switches at 3 ([2], source 1)
# and 6 ([1, 2], source 0).
ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--epas-target-layers", "2", "--epas-interval", "3", "--epas-exclude-last", "1",
        "--eval-interval", "8", "--eval-iters", "2", "--seed", "3", "--init-method-std", "0.1"]
RESUME_AT = 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run_trainer([*ARGS, "--save-interval", str(RESUME_AT)], tmp_path_factory.mktemp("exclude_last") / "run")


def test_switches_follow_the_schedule(uninterrupted):
    switches = [(s["iteration"], s["sharing_layers"], s["source_layer"]) for s in uninterrupted.switches]
    assert switches == [(3, [2], 1), (6, [1, 2], 0)]
    assert {r["iteration"]: r["sharing_layers"] for r in uninterrupted.train_records} == {
        1: [], 2: [], 3: [2], 4: [2], 5: [2], 6: [1, 2], 7: [1, 2], 8: [1, 2]}
    assert "layer(s) 3 never share (--epas-exclude-last 1)" in uninterrupted.stdout
    meta = json.loads((uninterrupted.output_dir / "checkpoints" / "iter_0000008" / "run_meta.json").read_text())
    assert meta["epas_schedule"]["exclude_last"] == 1 and meta["sharing_layers"] == [1, 2]


def test_resume_from_a_mid_run_checkpoint_is_bit_identical(uninterrupted, tmp_path):
    checkpoint = uninterrupted.output_dir / "checkpoints" / f"iter_{RESUME_AT:07d}"
    resumed = run_trainer([*ARGS, "--load", str(checkpoint)], tmp_path / "run")
    later = lambda values: {k: v for k, v in values.items() if k > RESUME_AT}
    assert resumed.losses == later(uninterrupted.losses)
    assert resumed.grad_norms == later(uninterrupted.grad_norms)
    assert [(s["iteration"], s["sharing_layers"]) for s in resumed.switches] == [(6, [1, 2])]
    assert resumed.summary["final_valid_lm_loss"] == uninterrupted.summary["final_valid_lm_loss"]


def test_epas_eval_builds_the_checkpoints_regions(uninterrupted, capsys):
    from epas_megatron.evaluate import main

    checkpoints = str(uninterrupted.output_dir / "checkpoints")
    code = main(["--load", checkpoints, "--regions", "0,1,max", "--eval-iters", "2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    payload = json.loads([line for line in captured.out.splitlines() if line.startswith("EVAL ")][-1][5:])
    assert [r["sharing_layers"] for r in payload["results"]] == [[], [2], [1, 2]] and payload["exclude_last"] == 1
    # The trained region, rebuilt from the checkpoint, reproduces the trainer's validation loss.
    assert payload["results"][2]["lm_loss"] == pytest.approx(uninterrupted.summary["final_valid_lm_loss"], rel=1e-6)
    # At most 2 layers can share: one source before the region, layer 3 after it.
    code = main(["--load", checkpoints, "--regions", "3", "--allow-untrained-regions"])
    captured = capsys.readouterr()
    assert code == 2 and "--regions: 3 sharing layers" in captured.err and "--epas-exclude-last 1" in captured.err


def test_generator_runs_the_checkpoints_region(uninterrupted):
    from epas_megatron.errors import ConfigError
    from epas_megatron.inference.generator import Generator
    from epas_megatron.runtime.distributed import destroy_distributed

    checkpoints = uninterrupted.output_dir / "checkpoints"
    try:
        generator = Generator.from_checkpoint(checkpoints)
        assert generator.engine.modes == ("source", "share", "share", "compute") and generator.region == 2
        assert len(generator.generate(["The history of"], max_new_tokens=3)[0].tokens) >= 1
        with pytest.raises(ConfigError, match="at most 2"):
            Generator.from_checkpoint(checkpoints, region=3, allow_untrained_region=True)
    finally:
        destroy_distributed()
