"""``epas-convert hf-export --region``: what the directory holds, and its logits at every region
0..R against this framework's model on the same checkpoint, the plain-PyTorch reference
(``llama_reference``) and, at region 0, transformers' own ``LlamaForCausalLM``; ``hf-import``
reads it back with its region; the refusals of ``--region``."""

import json

import pytest
import torch

from epas_megatron.convert.cli import main as convert
from llama_reference import forward

LAYERS, HEADS, GROUPS = 4, 4, 2  # the tiny preset
TRAINED = (2, 3)  # the fixture run's sharing region (conftest.py)


def test_the_directory_holds_config_code_weights_and_tokenizer(exported):
    from safetensors import safe_open

    names = sorted(p.name for p in exported.iterdir())
    for name in ("config.json", "model.safetensors", "configuration_epas_llama.py", "modeling_epas_llama.py",
                 "cache_epas.py", "tokenization_epas.py", "tokenizer.model", "tokenizer_config.json"):
        assert name in names
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "epas_llama" and config["epas_share"] == "qk"
    assert config["epas_sharing_layers"] == list(TRAINED) and config["epas_region"] == len(TRAINED)
    assert config["auto_map"] == {"AutoConfig": "configuration_epas_llama.EpasLlamaConfig",
                                  "AutoModelForCausalLM": "modeling_epas_llama.EpasLlamaForCausalLM"}
    with safe_open(exported / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
    for layer in range(LAYERS):
        attn = f"model.layers.{layer}.self_attn."
        if layer in TRAINED:  # owns V (and o_proj); Q/K kept frozen under their own names
            assert {attn + "v_proj.weight", attn + "frozen_q_proj.weight", attn + "frozen_k_proj.weight"} <= keys
            assert attn + "q_proj.weight" not in keys and attn + "k_proj.weight" not in keys
        else:
            assert {attn + f"{x}_proj.weight" for x in "qkv"} <= keys and not any(k.startswith(attn + "frozen") for k in keys)


def test_frozen_projections_do_not_train(exported, load_export):
    model = load_export(exported)
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == sorted(f"model.layers.{i}.self_attn.frozen_{x}_proj.weight" for i in TRAINED for x in "qk")


@pytest.mark.parametrize("region", [0, 1, 2])
def test_logits_equal_the_framework_and_the_reference(region, checkpoint, exported, reference_weights, tokens, world,
                                                      load_export, framework_model):
    ours = framework_model(checkpoint, region).eval()
    hf = load_export(exported, epas_region=region).eval()
    assert hf.config.epas_active_layers == TRAINED[len(TRAINED) - region:]
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        expected = ours(tokens, position_ids, None)[..., :512]
        reference = forward(reference_weights, tokens, LAYERS, HEADS, GROUPS, sharing=hf.config.epas_active_layers, share="qk")
        logits = hf(tokens).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_region_0_is_transformers_llama(exported, plain_exported, tokens, load_export):
    from transformers import LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(plain_exported, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = llama(tokens).logits
        assert not torch.allclose(load_export(exported)(tokens).logits, expected, atol=1e-3)  # region 2 differs
        torch.testing.assert_close(load_export(exported, epas_region=0)(tokens).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def imported(exported, tmp_path_factory):
    path = tmp_path_factory.mktemp("import") / "ckpt"
    assert convert(["hf-import", "--hf-dir", str(exported), "--output", str(path)]) == 0
    return path


def test_import_reads_the_region_back(imported, checkpoint, tokens, world, framework_model):
    from epas_megatron.checkpointing.integrity import open_checkpoint

    _, meta = open_checkpoint(imported, "--load", needs_config=True)
    assert (meta.sharing_layers, meta.epas_share, meta.trained_region) == (TRAINED, "qk", 2)
    position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        for region in (0, 2):  # the imported checkpoint's model == the original's, at both ends
            torch.testing.assert_close(framework_model(imported, region)(tokens, position_ids, None),
                                       framework_model(checkpoint, region)(tokens, position_ids, None), rtol=0, atol=0)


@pytest.mark.parametrize("region, message", [
    ("3", "--region 3: must be between 0 and 2"),
    ("half", "--region 'half': give a number of sharing layers or 'max'"),
    ("-1", "--region -1: must be between 0 and 2"),
])
def test_a_region_it_cannot_export(region, message, checkpoint, tmp_path, capsys):
    output = tmp_path / "out"
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(output), "--region", region]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err and err.count("\n") == 1
    assert not output.exists()
