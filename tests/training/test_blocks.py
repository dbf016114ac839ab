"""--epas-blocks end to end on tiny runs in bf16 and fp16 (the precisions users run): the
schedule's switches and sources in metrics.jsonl, the checkpoint's blocks, a bit-identical resume
from a mid-run checkpoint (the model still learns after it), the checkpoint's regions in epas-eval
and the Generator, and the refusals."""

import json

import pytest

from epas_testing import TINY, run_trainer

# 4 layers in two spans (0-1, 2-3), a target of 2: blocks [1] and [3] with sources 0 and 2;
# switches at 3 ([3], source 2) and 6 ([1], so the region is [1, 3], sources 0 and 2).
ARGS = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--epas-target-layers", "2", "--epas-interval", "3", "--epas-blocks", "2",
        "--eval-interval", "8", "--eval-iters", "2", "--seed", "5", "--init-method-std", "0.1", "--lr", "3e-3"]
RESUME_AT = 4


PRECISION = {"bf16": ["--precision", "bf16"], "fp16": ["--precision", "fp16", "--initial-loss-scale", "4096"]}


@pytest.fixture(scope="module", params=list(PRECISION))
def uninterrupted(request, tmp_path_factory):
    run = run_trainer([*ARGS, *PRECISION[request.param], "--save-interval", str(RESUME_AT)],
                      tmp_path_factory.mktemp(f"blocks-{request.param}") / "run")
    run.precision = request.param
    return run


def test_switches_follow_the_blocks_schedule(uninterrupted):
    switches = [(s["iteration"], s["sharing_layers"], s["source_layers"]) for s in uninterrupted.switches]
    assert switches == [(3, [3], [2]), (6, [1, 3], [0, 2])]
    assert {r["iteration"]: r["sharing_layers"] for r in uninterrupted.train_records} == {
        1: [], 2: [], 3: [3], 4: [3], 5: [3], 6: [1, 3], 7: [1, 3], 8: [1, 3]}
    assert "(source layers 0, 2)" in uninterrupted.stdout
    meta = json.loads((uninterrupted.output_dir / "checkpoints" / "iter_0000008" / "run_meta.json").read_text())
    assert meta["epas_schedule"]["blocks"] == 2 and meta["sharing_layers"] == [1, 3]


def test_resume_from_a_mid_run_checkpoint_is_bit_identical_and_learns(uninterrupted, tmp_path):
    checkpoint = uninterrupted.output_dir / "checkpoints" / f"iter_{RESUME_AT:07d}"
    resumed = run_trainer([*ARGS, *PRECISION[uninterrupted.precision], "--load", str(checkpoint)], tmp_path / "run")
    later = lambda values: {k: v for k, v in values.items() if k > RESUME_AT}
    assert resumed.losses == later(uninterrupted.losses)
    assert resumed.grad_norms == later(uninterrupted.grad_norms)
    assert [(s["iteration"], s["sharing_layers"]) for s in resumed.switches] == [(6, [1, 3])]
    # The model learns through both switches and the resume: the last steps' loss is below the first's.
    first, last = (uninterrupted.losses[1] + uninterrupted.losses[2]) / 2, (resumed.losses[7] + resumed.losses[8]) / 2
    assert last < first - 0.05, uninterrupted.losses
    # Resuming with another block count is refused, naming the flag.
    other = run_trainer([*ARGS, *PRECISION[uninterrupted.precision], "--epas-blocks", "1", "--load", str(checkpoint)],
                        tmp_path / "other", check=False)
    assert other.returncode == 2 and "--epas-blocks: 2 in the checkpoint, 1 in this run" in other.stderr


@pytest.mark.parametrize("uninterrupted", ["bf16"], indirect=True)  # one precision is enough here
def test_epas_eval_and_the_generator_build_the_checkpoints_blocks(uninterrupted, capsys):
    from epas_megatron.errors import ConfigError
    from epas_megatron.evaluate import main
    from epas_megatron.inference.generator import Generator
    from epas_megatron.runtime.distributed import destroy_distributed

    checkpoints = str(uninterrupted.output_dir / "checkpoints")
    code = main(["--load", checkpoints, "--regions", "0,1,max", "--eval-iters", "2", "--precision", "bf16"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    payload = json.loads([line for line in captured.out.splitlines() if line.startswith("EVAL ")][-1][5:])
    assert [r["sharing_layers"] for r in payload["results"]] == [[], [3], [1, 3]] and payload["blocks"] == 2
    # The trained region, rebuilt from the checkpoint, reproduces the trainer's validation loss.
    assert payload["results"][2]["lm_loss"] == pytest.approx(uninterrupted.summary["final_valid_lm_loss"], rel=1e-6)
    code = main(["--load", checkpoints, "--regions", "3", "--allow-untrained-regions"])
    captured = capsys.readouterr()
    assert code == 2 and "at most 2" in captured.err and "--epas-blocks 2" in captured.err
    try:
        generator = Generator.from_checkpoint(checkpoints)
        assert generator.engine.modes == ("source", "share", "source", "share") and generator.region == 2
        assert len(generator.generate(["The history of"], max_new_tokens=3)[0].tokens) >= 1
        with pytest.raises(ConfigError, match="at most 2"):
            Generator.from_checkpoint(checkpoints, region=3, allow_untrained_region=True)
    finally:
        destroy_distributed()


def test_bad_block_counts_are_refused_before_training(tmp_path):
    for blocks, message in (("3", "--epas-blocks 3 does not divide --epas-target-layers 2"),
                            ("0", "--epas-blocks must be an integer >= 1")):
        run = run_trainer([*ARGS, "--epas-blocks", blocks], tmp_path / blocks, check=False)
        assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
    run = run_trainer([*ARGS, "--epas-target-layers", "3", "--epas-growth", "3", "--epas-blocks", "3"], tmp_path / "fit",
                      check=False)
    assert run.returncode == 2 and "each block of 1 layer(s) needs a computing source layer" in run.stderr


@pytest.mark.parametrize("uninterrupted", ["bf16"], indirect=True)
def test_hf_export_keeps_the_blocks_and_import_reads_them_back(uninterrupted, tmp_path, monkeypatch):
    """The exported model (transformers, trust_remote_code) at every region equals this framework's
    model at that region (fp32, from the checkpoint): regions grow in the training's order (3,
    then 1); hf-import finds the two blocks again from that order."""
    import torch
    from transformers import AutoModelForCausalLM

    from epas_megatron.assembly import plan_for_checkpoint
    from epas_megatron.checkpointing.checkpoint import load_checkpoint
    from epas_megatron.checkpointing.integrity import open_checkpoint
    from epas_megatron.convert.cli import main
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # everything loaded is built here
    checkpoints, exported, imported = uninterrupted.output_dir / "checkpoints", tmp_path / "hf", tmp_path / "imported"
    assert main(["hf-export", "--load", str(checkpoints), "--output", str(exported), "--region", "max"]) == 0
    assert main(["hf-import", "--hf-dir", str(exported), "--output", str(imported)]) == 0

    def framework(path, region):
        resolved, meta = open_checkpoint(path, "--load", needs_config=True)
        model = build_model(plan_for_checkpoint(meta, region, precision="fp32", backend="local"), seed=0).chunks[0].eval()
        load_checkpoint(resolved, [model], restore_rng=False)
        return model, meta

    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand_as(tokens)
    init_distributed(1, 1, None, seed=0)
    try:
        for region, active in ((0, ()), (1, (3,)), (2, (1, 3))):
            hf = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32, epas_region=region).eval()
            assert hf.config.epas_active_layers == active and hf.config.epas_region_order == [3, 1]
            ours, _ = framework(checkpoints, region)
            back, meta = framework(imported, region)
            assert (meta.blocks, meta.sharing_layers) == (2, (1, 3))
            with torch.no_grad():
                expected = ours(tokens, positions, None)[..., :512]
                torch.testing.assert_close(hf(tokens).logits, expected, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(back(tokens, positions, None)[..., :512], expected, rtol=0, atol=0)
    finally:
        destroy_distributed()
