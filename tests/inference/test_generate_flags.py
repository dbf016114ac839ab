"""epas-generate's README flags end to end through the command's ``main``, on the session's
trained checkpoint (trained region 2 of 4 layers): each flag takes effect (the ``GENERATE``
record says what ran) and gives the tokens an independent derivation predicts."""

import json

import pytest

from epas_megatron.generate import main

PROMPTS = ["The history of", "In", "A small"]


def generate(capsys, *argv):
    code = main([*argv, "--json", "--max-new-tokens", "6"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("GENERATE ")]
    return json.loads(lines[-1][len("GENERATE "):])


def tokens(payload):
    return [r["tokens"] for r in payload["results"]]


@pytest.fixture(scope="module")
def checkpoint(tiny_epas_run):
    return str(tiny_epas_run.output_dir / "checkpoints")


@pytest.fixture(scope="module")
def greedy(checkpoint):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["--load", checkpoint, *[a for p in PROMPTS for a in ("--prompt", p)], "--json", "--max-new-tokens", "6",
                     "--decode-attention", "qk"]) == 0
    return json.loads([line for line in out.getvalue().splitlines() if line.startswith("GENERATE ")][-1][9:])


def test_decode_attention_and_region_kernel_take_effect_and_agree(checkpoint, greedy, capsys):
    """The Q/K path, probability reuse and reuse with the region's P.V in one torch launch are
    three computations of the same attention: the same greedy tokens."""
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    assert (greedy["decode_attention"], greedy["region_kernel"]) == ("qk", None)
    reuse = generate(capsys, "--load", checkpoint, *prompts, "--decode-attention", "reuse")
    kernel = generate(capsys, "--load", checkpoint, *prompts, "--decode-attention", "reuse", "--region-kernel", "torch")
    assert (reuse["decode_attention"], reuse["region_kernel"]) == ("reuse", None)
    assert (kernel["decode_attention"], kernel["region_kernel"]) == ("reuse", "torch")
    assert tokens(reuse) == tokens(kernel) == tokens(greedy)


def test_sampling_flags(checkpoint, greedy, capsys):
    """top-k 1 and a top-p that keeps only the most likely token leave one candidate: greedy's
    tokens at any temperature. A seeded temperature sample repeats with its seed."""
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    top_k = generate(capsys, "--load", checkpoint, *prompts, "--temperature", "1.5", "--top-k", "1", "--seed", "7")
    top_p = generate(capsys, "--load", checkpoint, *prompts, "--temperature", "1.5", "--top-p", "1e-6", "--seed", "7")
    assert tokens(top_k) == tokens(top_p) == tokens(greedy)
    sampled = [tokens(generate(capsys, "--load", checkpoint, *prompts, "--temperature", "2.0", "--seed", str(seed)))
               for seed in (11, 11, 12)]
    assert sampled[0] == sampled[1]
    assert sampled[0] != tokens(greedy) or sampled[2] != tokens(greedy)  # a hot sample is not the argmax throughout


def test_prompt_file_is_one_prompt_per_line(checkpoint, greedy, capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    from_file = generate(capsys, "--load", checkpoint, "--prompt-file", str(path), "--decode-attention", "qk")
    assert [r["prompt"] for r in from_file["results"]] == PROMPTS
    assert tokens(from_file) == tokens(greedy)
