"""epas-generate and the Generator API on a checkpoint trained with EPAS: regions, the exported
Hugging Face model's own generate() at region 0, and clear errors for bad input."""

import json

import pytest
import torch

from epas_megatron.generate import main


@pytest.fixture(scope="module")
def checkpoint(tiny_epas_run):
    return tiny_epas_run.output_dir / "checkpoints"  # tests/conftest.py: trained region 2 of 4 layers


def generate(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    lines = [l for l in captured.out.splitlines() if l.startswith("GENERATE ")]
    return code, (json.loads(lines[-1][9:]) if lines else None), captured


def test_cli_generates_at_every_region_and_streams(checkpoint, capsys):
    outputs = {}
    for region in ("0", "1", "max"):
        code, payload, captured = generate(capsys, "--load", str(checkpoint), "--region", region, "--prompt", "The history of",
                                           "--prompt", "A", "--max-new-tokens", "5", "--json")
        assert code == 0, captured.err
        assert payload["trained_region"] == 2 and payload["region"] == {"0": 0, "1": 1, "max": 2}[region]
        assert all(len(r["tokens"]) == 5 or r["finish_reason"] == "eos" for r in payload["results"])
        outputs[region] = payload
    assert outputs["max"]["decode_attention"] == "reuse"
    # one prompt streams: the prompt, then the continuation, on stdout
    code, payload, captured = generate(capsys, "--load", str(checkpoint), "--prompt", "The history of", "--max-new-tokens", "5", "--json")
    assert code == 0
    assert captured.out.startswith("The history of" + payload["results"][0]["text"])
    assert payload["results"][0]["tokens"] == outputs["max"]["results"][0]["tokens"]  # batching does not change tokens


def test_qk_and_reuse_generate_the_same_tokens(checkpoint):
    from epas_megatron.inference.generator import Generator
    from epas_megatron.runtime.distributed import destroy_distributed

    try:
        prompts = ["The history of", "In", "A small"]
        results = {}
        for attention in ("qk", "reuse"):
            gen = Generator.from_checkpoint(checkpoint, decode_attention=attention)
            results[attention] = [r.tokens for r in gen.generate(prompts, max_new_tokens=6)]
        assert results["qk"] == results["reuse"]
    finally:
        destroy_distributed()


def test_region_0_matches_transformers_generate_on_the_export(checkpoint, tmp_path):
    from transformers import LlamaForCausalLM

    from epas_megatron.convert.cli import main as convert
    from epas_megatron.inference.generator import Generator
    from epas_megatron.runtime.distributed import destroy_distributed

    exported = tmp_path / "hf"
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(exported)]) == 0
    hf = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    try:
        gen = Generator.from_checkpoint(checkpoint, region=0)
        for prompt in ("The history of", "Once upon a time there"):
            ids = gen.tokenizer.tokenize(prompt)
            ours = gen.generate([ids], max_new_tokens=8, eos_id=-1)[0].tokens  # never stop early
            with torch.no_grad():
                theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
            assert ours == theirs[0, len(ids):].tolist(), prompt
    finally:
        destroy_distributed()


@pytest.mark.parametrize("argv,message", [
    (["--region", "3"], "--region: 3 is larger than the region this checkpoint was trained with (2 layers)"),
    (["--region", "4"], "at most 3"),
    (["--prompt", ""], "prompt 1 is empty"),
    (["--max-new-tokens", "60", "--prompt", "word " * 10], "exceeds the model's context of 64 positions"),
    (["--temperature", "0.5", "--greedy"], "contradict"),
])
def test_bad_input_is_one_error_line(checkpoint, capsys, argv, message):
    if "--prompt" not in argv:
        argv = [*argv, "--prompt", "Hello"]
    code, payload, captured = generate(capsys, "--load", str(checkpoint), *argv)
    assert code == 2 and payload is None
    errors = [l for l in captured.err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], captured.err


def test_missing_checkpoint_and_prompt_file(tmp_path, capsys):
    code, _, captured = generate(capsys, "--load", str(tmp_path / "nowhere"), "--prompt", "x")
    assert code == 2 and "nowhere: no such directory" in captured.err
    code, _, captured = generate(capsys, "--load", str(tmp_path), "--prompt-file", str(tmp_path / "none.txt"))
    assert code == 2 and "--prompt-file" in captured.err
