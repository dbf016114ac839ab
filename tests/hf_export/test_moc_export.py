"""``hf-export`` of a Mixture-of-Channels model (``--moc-topk 0.25 --moc-groups 4``, a few fp32
training steps with EPAS switches): the export's logits, loaded by transformers with remote code
and no network, equal this framework's model on the same checkpoint at region 0 and at the
trained region; the same weights through transformers' dense ``LlamaMLP`` give other logits (the
control); the export without ``--region`` is the EPAS modeling code at region 0; ``hf-import``
reads the Top-K back; ``epas-generate``'s greedy tokens equal a greedy decode by full forwards
of the exported model (no cache); on planted ties at the Top-K boundary (tests/moc_reference.py)
the exported MLP -- the shipped ``moc_topk.py``, loaded as remote code -- keeps the channels of
this framework's MLP and of the reference rule."""

import contextlib
import io
import json

import pytest
import torch

from epas_megatron.convert.cli import main as convert
from epas_megatron.generate import main as generate
from epas_testing import TINY, run_trainer
from moc_reference import assert_close_to_reference, higher_index_channels, masked_swiglu, planted_inputs, planted_weights

TOPK, GROUPS, KEPT = 0.25, 4, 11  # tiny: ffn 176 -> 4 groups of 44, 11 kept per token and group
TRAINED = (2, 3)
PROMPTS = ["Return the absolute value of", "If the list is empty"]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moc_checkpoint(tmp_path_factory):
    """3 iterations: region [3] from iteration 1, [2, 3] from iteration 2."""
    run = run_trainer([*TINY, "--train-iters", "3", "--global-batch-size", "2", "--micro-batch-size", "2",
                       "--epas-target-layers", "2", "--epas-interval", "1", "--init-method-std", "0.1", "--lr", "1e-3",
                       "--moc-topk", str(TOPK), "--moc-groups", str(GROUPS)], tmp_path_factory.mktemp("moc") / "run")
    assert [s["sharing_layers"] for s in run.switches] == [[3], list(TRAINED)]
    assert "Mixture-of-Channels" in run.stdout
    return run.output_dir / "checkpoints"


@pytest.fixture(scope="module")
def moc_exported(moc_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("moc_export") / "epas"
    assert convert(["hf-export", "--load", str(moc_checkpoint), "--output", str(path), "--region", "max"]) == 0
    return path


def test_the_config_records_the_top_k(moc_exported, load_export):
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = json.loads((moc_exported / "config.json").read_text())
    assert (config["moc_topk"], config["moc_groups"]) == (TOPK, GROUPS)
    model = load_export(moc_exported)
    assert model.config.moc_kept_channels == KEPT
    assert all(type(layer.mlp).__name__ == "EpasMoCMLP" and layer.mlp.kept == KEPT for layer in model.model.layers)
    assert not any(isinstance(layer.mlp, LlamaMLP) for layer in model.model.layers)


def test_the_kept_count_is_the_frameworks():
    from epas_megatron.hf import EpasLlamaConfig
    from epas_megatron.model.moc import kept_channels

    for ffn, groups, topk in [(176, 4, 0.25), (176, 8, 0.2), (11008, 8, 0.2), (64, 2, 0.01), (96, 3, 0.999), (48, 1, 0.5)]:
        config = EpasLlamaConfig(intermediate_size=ffn, moc_topk=topk, moc_groups=groups)
        assert config.moc_kept_channels == kept_channels(ffn, groups, topk)
    assert EpasLlamaConfig().moc_kept_channels is None  # no fields: the dense MLP, as every earlier export


@pytest.mark.parametrize("region", [0, 2])
def test_logits_equal_the_framework_and_a_dense_mlp_gives_others(region, moc_checkpoint, moc_exported, tokens, world,
                                                                 load_export, framework_model):
    ours = framework_model(moc_checkpoint, region).eval()
    hf = load_export(moc_exported, epas_region=region).eval()
    assert hf.config.epas_active_layers == TRAINED[len(TRAINED) - region:]
    dense = load_export(moc_exported, epas_region=region, moc_topk=1.0).eval()  # the control: the same weights, LlamaMLP
    assert type(dense.model.layers[0].mlp).__name__ == "LlamaMLP"
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        expected = ours(tokens, position_ids, None)[..., :512]
        logits, dense_logits = hf(tokens).logits, dense(tokens).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert (dense_logits - expected).abs().max() > 1e-2


def test_on_planted_ties_the_export_keeps_the_channels_of_training(moc_checkpoint, moc_exported, world, framework_model):
    """Exact small-integer gate values, ties at the boundary in most groups (one token ties three
    channels for the last two places), in both MLPs of layer 0: the output of the export's MLP
    ([b, s, h]) and of this framework's MoCMLP ([s, b, h]) equal the masked SwiGLU of the reference
    rule (ties to the lower index); the control rule's mask gives another output."""
    import sys

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from epas_megatron.hf import SOURCE_DIR

    assert (moc_exported / "moc_topk.py").read_text() == (SOURCE_DIR / "moc_topk.py").read_text()
    # The directory's own code (from_pretrained takes this package's registered classes where it is
    # imported): the shipped modeling file, which imports the shipped moc_topk.py
    remote = get_class_from_dynamic_module("modeling_epas_llama.EpasLlamaForCausalLM", moc_exported)
    assert remote.__module__.startswith("transformers_modules.")
    assert sys.modules[remote.__module__].topk_channels.__module__.startswith("transformers_modules.")
    exported = remote.from_pretrained(moc_exported, dtype=torch.float32).model.layers[0].mlp
    assert type(exported).__module__ == remote.__module__
    ours = framework_model(moc_checkpoint, 0).decoder.layers[0].mlp
    hidden, ffn = ours.linear_fc2.weight.shape
    fc1, fc2 = (w.float() for w in planted_weights(hidden, ffn, GROUPS, KEPT))
    with torch.no_grad():
        ours.linear_fc1.weight.copy_(fc1)
        ours.linear_fc2.weight.copy_(fc2)
        exported.gate_proj.weight.copy_(fc1[:ffn])
        exported.up_proj.weight.copy_(fc1[ffn:])
        exported.down_proj.weight.copy_(fc2)
        x = planted_inputs((5, 2), hidden).float()  # [s, b, h]
        training, export = ours(x)[0], exported(x.transpose(0, 1)).transpose(0, 1)
    reference = masked_swiglu(x, fc1, fc2, GROUPS, KEPT)
    assert_close_to_reference(training, reference, torch.float32)
    assert_close_to_reference(export, reference, torch.float32)
    control = masked_swiglu(x, fc1, fc2, GROUPS, KEPT, rule=higher_index_channels)
    assert (control - reference).abs().max() > 0.2 * reference.abs().max()


@pytest.fixture(scope="module")
def moc_plain_exported(moc_checkpoint, tmp_path_factory):
    """``hf-export`` without ``--region``, and what it printed."""
    path = tmp_path_factory.mktemp("moc_export") / "plain"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert convert(["hf-export", "--load", str(moc_checkpoint), "--output", str(path)]) == 0
    return path, printed.getvalue()


def test_without_region_it_exports_the_epas_code_at_region_0(moc_checkpoint, moc_plain_exported, tokens, world, load_export,
                                                             framework_model):
    path, printed = moc_plain_exported
    assert "exports as an EpasLlamaForCausalLM at region 0" in printed
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "epas_llama" and config["epas_sharing_layers"] == [] and config["moc_topk"] == TOPK
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        torch.testing.assert_close(load_export(path).eval()(tokens).logits,
                                   framework_model(moc_checkpoint, 0).eval()(tokens, position_ids, None)[..., :512],
                                   rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def moc_imported(moc_exported, tmp_path_factory):
    path = tmp_path_factory.mktemp("moc_import") / "ckpt"
    assert convert(["hf-import", "--hf-dir", str(moc_exported), "--output", str(path)]) == 0
    return path


def test_import_reads_the_top_k_back(moc_checkpoint, moc_imported, tokens, world, framework_model):
    from epas_megatron.checkpointing.integrity import open_checkpoint

    imported = moc_imported
    _, meta = open_checkpoint(imported, "--load", needs_config=True)
    model = meta.run_config().model
    assert (model.moc_topk, model.moc_groups, meta.trained_region) == (TOPK, GROUPS, 2)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        for region in (0, 2):
            torch.testing.assert_close(framework_model(imported, region)(tokens, position_ids, None),
                                       framework_model(moc_checkpoint, region)(tokens, position_ids, None), rtol=0, atol=0)


def full_forward_greedy(model, ids, new_tokens, eos):
    """Greedy continuation by a full forward over the whole sequence per token (no cache), up to EOS."""
    ids, out = list(ids), []
    for _ in range(new_tokens):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        out.append(token)
        if token == eos:
            break
    return out


@pytest.mark.parametrize("moc_decode", ["masked", "sparse"])
def test_epas_generate_equals_a_greedy_decode_of_the_export(moc_decode, moc_checkpoint, moc_exported, load_export, capsys):
    from transformers import AutoTokenizer

    argv = ["--load", str(moc_checkpoint), "--max-new-tokens", str(NEW_TOKENS), "--json", "--moc-decode", moc_decode]
    code = generate([*argv, *(a for p in PROMPTS for a in ("--prompt", p))])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    payload = json.loads([line for line in captured.out.splitlines() if line.startswith("GENERATE ")][-1][9:])
    assert payload["region"] == 2 and payload["moc_decode"] == moc_decode
    ours = [r["tokens"] for r in payload["results"]]
    tokenizer = AutoTokenizer.from_pretrained(moc_exported, trust_remote_code=True)
    model = load_export(moc_exported).eval()
    expected = [full_forward_greedy(model, tokenizer(p)["input_ids"], NEW_TOKENS, tokenizer.eos_token_id) for p in PROMPTS]
    assert ours == expected
