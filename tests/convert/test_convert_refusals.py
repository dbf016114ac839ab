"""epas-convert's refusals: each is one `error:` line naming the flag, exit status 2, before anything
is written (a model this project cannot represent must not be imported half right)."""

import pytest

from epas_megatron.convert.cli import main as convert


def _hf_config_dir(path, **overrides):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, **overrides)
    config.save_pretrained(path)  # config.json only: the refusals come before any weight is read
    return path


@pytest.mark.parametrize("overrides, message", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "--hf-dir: RoPE scaling"),
    ({"attention_bias": True}, "--hf-dir: attention/MLP biases are not supported"),
    ({"mlp_bias": True}, "--hf-dir: attention/MLP biases are not supported"),
    ({"hidden_act": "gelu"}, "--hf-dir: activation 'gelu' is not SwiGLU/SiLU"),
], ids=["rope-scaling", "attention-bias", "mlp-bias", "activation"])
def test_models_it_cannot_represent(tmp_path, capsys, overrides, message):
    hf = _hf_config_dir(tmp_path / "hf", **overrides)
    output = tmp_path / "out"
    assert convert(["hf-import", "--hf-dir", str(hf), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [line for line in err.splitlines() if line]
    assert message in err and "Traceback" not in err
    assert not output.exists()


def test_a_directory_without_config_json(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert convert(["hf-import", "--hf-dir", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --hf-dir {tmp_path / 'hf'}: no config.json"
    assert not (tmp_path / "out").exists()


def test_an_output_that_is_not_empty(tmp_path, capsys):
    hf = _hf_config_dir(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert convert(["hf-import", "--hf-dir", str(hf), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: --output {tmp_path / 'out'} is not empty"
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
