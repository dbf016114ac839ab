"""A checkpoint whose LM head is tied to the embedding (``--no-untie-embeddings-and-output-weights``,
as Llama-3.2-1B and many small LLaMA-family models are) through every consumer of the head:
training with switches, ``epas-eval``, ``epas-generate`` (eager steps), the lm-eval bridge,
``hf-export`` (plain and ``--region``) and ``hf-import`` of both, against the plain-PyTorch forward
of ``llama_reference`` on the plain export's weights (its head the embedding) and transformers'
own tied ``LlamaForCausalLM``. (The decode engine's fixed-shape step and ``epas-bench decode`` are
checked tied in tests/inference/test_engine.py and tests/bench/test_decode_bench.py; PP=2 with a
tied head in tests/distributed/test_parallel_equivalence.py.)"""

import json

import pytest
import torch

from epas_megatron.convert.cli import main as convert
from epas_testing import TINY, run_trainer
from export_reference import Reference

TIED = "--no-untie-embeddings-and-output-weights"
PROMPT = "Return the absolute value of"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 iterations, region [3] from 1 and [2, 3] from 2, validation at the end."""
    run = run_trainer([*TINY, TIED, "--train-iters", "3", "--global-batch-size", "2", "--micro-batch-size", "2",
                       "--epas-target-layers", "2", "--epas-interval", "1", "--init-method-std", "0.1", "--lr", "1e-3",
                       "--eval-interval", "3", "--eval-iters", "2"], tmp_path_factory.mktemp("tied") / "run")
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    return run


@pytest.fixture(scope="module")
def checkpoint(run):
    return run.output_dir / "checkpoints"


@pytest.fixture(scope="module")
def exports(checkpoint, tmp_path_factory):
    """The plain export (region 0) and the EPAS export (``--region max``)."""
    root = tmp_path_factory.mktemp("tied-export")
    paths = {"plain": root / "plain", "epas": root / "epas"}
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(paths["plain"])]) == 0
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(paths["epas"]), "--region", "max"]) == 0
    return paths


@pytest.fixture(scope="module")
def reference(exports):
    return Reference(exports["plain"], 64)


def test_training_ties_the_head_and_learns(run, checkpoint):
    meta = json.loads(sorted(checkpoint.glob("iter_*"))[-1].joinpath("run_meta.json").read_text())
    assert meta["model"]["untie_embeddings_and_output_weights"] is False
    losses = run.losses
    assert losses[3] < losses[1]


def test_exports_are_tied_and_equal_the_reference(exports, reference, load_export):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    for path in exports.values():
        assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
        assert "lm_head.weight" not in load_file(path / "model.safetensors")
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    plain = LlamaForCausalLM.from_pretrained(exports["plain"], dtype=torch.float32).eval()
    epas = load_export(exports["epas"]).eval()
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert epas.lm_head.weight is epas.model.embed_tokens.weight
    for model, region in ((plain, 0), (epas, 2)):
        with torch.no_grad():
            logits = model(tokens).logits[0, :, :reference.tokenizer.vocab_size]
        torch.testing.assert_close(torch.log_softmax(logits.double(), -1), reference.logprobs(tokens[0].tolist(), region),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which, region", [("plain", 0), ("epas", 2)])
def test_import_of_each_export_generates_like_the_reference(which, region, exports, reference, tmp_path, capsys):
    from epas_megatron.generate import main as generate

    imported = tmp_path / "imported"
    assert convert(["hf-import", "--hf-dir", str(exports[which]), "--output", str(imported)]) == 0
    meta = json.loads((imported / "iter_0000000" / "run_meta.json").read_text())
    assert meta["model"]["untie_embeddings_and_output_weights"] is False and len(meta["sharing_layers"]) == region
    assert_generates_like(generate, capsys, imported, region, reference)


def assert_generates_like(generate, capsys, checkpoint, region, reference):
    capsys.readouterr()
    assert generate(["--load", str(checkpoint), "--region", str(region), "--prompt", PROMPT, "--max-new-tokens",
                     str(NEW_TOKENS), "--greedy", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads([line for line in out.splitlines() if line.startswith("GENERATE ")][-1][9:])["results"][0]
    expected = reference.greedy(reference.tokenizer.tokenize(PROMPT), region, NEW_TOKENS)
    got = result["tokens"]
    if result["finish_reason"] == "eos":  # stopped at the end-of-text token the reference also chose
        expected = expected[:len(got)]
    assert got == expected


@pytest.mark.parametrize("region", [0, 2])
def test_epas_generate_on_the_checkpoint_equals_the_reference(region, checkpoint, reference, capsys):
    from epas_megatron.generate import main as generate

    assert_generates_like(generate, capsys, checkpoint, region, reference)


def test_epas_eval_reproduces_training_validation(run, checkpoint, capsys):
    from epas_megatron.evaluate import main as evaluate

    capsys.readouterr()
    assert evaluate(["--load", str(checkpoint), "--regions", "0,max", "--eval-iters", "2"]) == 0
    payload = json.loads([line for line in capsys.readouterr().out.splitlines() if line.startswith("EVAL ")][-1][5:])
    assert [r["region"] for r in payload["results"]] == [0, 2]
    assert payload["results"][1]["lm_loss"] == pytest.approx(run.summary["final_valid_lm_loss"], rel=1e-6)


def test_lm_eval_loglikelihoods_equal_the_reference(checkpoint, reference):
    from epas_megatron.evaluation.lm_eval_model import EpasLM
    from epas_megatron.runtime.distributed import destroy_distributed

    requests = [("Return the absolute", " value of a number."), ("", "Return None."), ("The socket must be", " bound.")]
    try:
        for region in (0, 2):
            model = EpasLM.create_from_arg_string(f"load={checkpoint},region={region}", {"batch_size": "2", "device": None})
            for request, (logprob, greedy) in zip(requests, model.loglikelihood(requests)):
                expected, expected_greedy = reference.loglikelihood(*request, region)
                assert logprob == pytest.approx(expected, abs=1e-4), (region, request)
                assert greedy == expected_greedy
            destroy_distributed()
    finally:
        destroy_distributed()
