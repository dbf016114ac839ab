"""Hugging Face import -> continual pretraining with EPAS -> export, checked against transformers."""

import json

import pytest
import torch

from epas_megatron.convert.cli import main as convert
from epas_testing import TINY, run_trainer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    # The `tiny` preset's shape, with the 512-piece default tokenizer of the embedded corpus.
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def hf_loss(model, batch):
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    return float((losses * batch["loss_mask"]).sum()), float(batch["loss_mask"].sum())


def test_import_continue_with_epas_and_export(hf_dir, tmp_path, capsys):
    from transformers import LlamaForCausalLM

    ckpt = tmp_path / "imported"
    assert convert(["hf-import", "--hf-dir", str(hf_dir), "--output", str(ckpt)]) == 0
    meta = json.loads((ckpt / "iter_0000000" / "run_meta.json").read_text())
    assert meta["model"]["num_query_groups"] == 2 and meta["sharing_layers"] == []

    run = run_trainer([*TINY, "--pretrained", str(ckpt), "--train-iters", "4", "--global-batch-size", "2",
                       "--micro-batch-size", "2", "--epas-target-layers", "2", "--epas-interval", "2",
                       "--lr", "1e-3"], tmp_path / "continued")
    assert "initialised from the weights of" in run.stdout
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]

    # Iteration 1 (region 0) trains the imported weights: its loss is the HF model's on that batch.
    from epas_megatron.data.datasets import build_data_iterator, build_gpt_datasets
    from epas_megatron.data.default_data import default_cache_dir, prepare_default_data
    from epas_megatron.data.tokenizer import load_tokenizer

    prefix, tok = prepare_default_data(default_cache_dir(), 512)
    train, _ = build_gpt_datasets([prefix], "969,30,1", seq_length=64, train_samples=8, valid_samples=0,
                                  seed=1234, tokenizer=load_tokenizer(tok), cache_dir=default_cache_dir())
    batch = next(build_data_iterator(train, 2, 0, 1, 0))
    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    loss_sum, tokens = hf_loss(hf, batch)
    assert run.losses[1] == pytest.approx(loss_sum / tokens, rel=1e-5)

    # Export the EPAS-trained checkpoint (layers 2-3 sharing) and compare with our region-0 model.
    exported = tmp_path / "exported"
    assert convert(["hf-export", "--load", str(run.output_dir / "checkpoints"), "--output", str(exported)]) == 0
    back = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()

    from epas_megatron.checkpointing.checkpoint import load_checkpoint, resolve_checkpoint
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    init_distributed(1, 1, None, seed=0)
    try:
        arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, 64)
        ours = build_model(BuildPlan.for_region(arch)).chunks[0].eval()
        load_checkpoint(resolve_checkpoint(run.output_dir / "checkpoints"), [ours], restore_rng=False)
        tokens = batch["tokens"]
        with torch.no_grad():
            ours_logits = ours(tokens, batch["position_ids"], None)
            theirs = back(tokens).logits
        torch.testing.assert_close(ours_logits, theirs, rtol=1e-5, atol=1e-5)
        # The weights did train (the export is not the import).
        assert not torch.allclose(theirs, hf(tokens).logits)
    finally:
        destroy_distributed()
