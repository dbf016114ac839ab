"""The lm-evaluation-harness bridge against an independent reference: the checkpoint exported to
Hugging Face weights and run through the plain-PyTorch forward of ``llama_reference`` (with
the same sharing region), tokenised by the documented rule; accuracies computed by hand from
those log-probabilities. Nothing is downloaded: the task is a YAML over a JSONL in this folder."""

import json
import math
import sys
from pathlib import Path

import pytest

from epas_megatron.evaluate import main
from epas_testing import hf_offline
from export_reference import Reference

TASKS = Path(__file__).resolve().parent / "tasks"
TASK = "epas_tiny_mc"
MAX_LENGTH = 64  # the tiny preset's context
LONG_TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key "
    "function can be supplied to customize the sort order, and the reverse flag can be set to "
    "request the result in descending order. The sort is guaranteed to be stable: it does not "
    "change the relative order of elements that compare equal. This module provides functions "
    "for working with paths, files and directories; the socket must be bound to an address."
)


offline = pytest.fixture(scope="module", autouse=True)(hf_offline)  # epas_testing.hf_offline


@pytest.fixture(scope="module")
def checkpoint(tiny_epas_run):
    return tiny_epas_run.output_dir / "checkpoints"  # tests/conftest.py: trained region 2 of 4 layers


@pytest.fixture(scope="module")
def include_dir(tmp_path_factory):
    """The task YAML with its data file's absolute path (lm_eval resolves it against the cwd)."""
    path = tmp_path_factory.mktemp("tasks")
    text = (TASKS / f"{TASK}.yaml.in").read_text().replace("@DATA_DIR@", str(TASKS))
    (path / f"{TASK}.yaml").write_text(text)
    return path


@pytest.fixture(scope="module")
def items():
    return [json.loads(line) for line in (TASKS / f"{TASK}.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(checkpoint, tmp_path_factory):
    from epas_megatron.convert.cli import main as convert

    exported = tmp_path_factory.mktemp("hf") / "export"
    assert convert(["hf-export", "--load", str(checkpoint), "--output", str(exported)]) == 0
    return Reference(exported, MAX_LENGTH)


@pytest.fixture(scope="module")
def models(checkpoint, reference):
    """EpasLM at regions 0 (built as lm_eval's command line builds it) and 2 (around a Generator)."""
    from lm_eval.api.registry import get_model

    from epas_megatron.evaluation.lm_eval_model import EpasLM
    from epas_megatron.inference.generator import Generator
    from epas_megatron.runtime.distributed import destroy_distributed

    assert get_model("epas") is EpasLM
    try:
        region0 = EpasLM.create_from_arg_string(f"load={checkpoint},region=0", {"batch_size": "3", "device": None})
        region2 = EpasLM(generator=Generator.from_checkpoint(checkpoint, region=2), batch_size=3)
        assert (region0.sharing_layers, region2.sharing_layers) == ([], [2, 3])
        yield {0: region0, 2: region2}
    finally:
        destroy_distributed()


def hand_accuracy(reference, items, region):
    """acc and acc_norm (log-likelihood / characters of the choice, lm_eval's definition)."""
    acc = acc_norm = 0
    for item in items:
        lls = [reference.loglikelihood(item["question"], " " + choice, region)[0] for choice in item["choices"]]
        ranked = sorted(lls)
        assert ranked[-1] - ranked[-2] > 1e-3, "near tie: the hand computation would not decide"
        norm = [ll / len(choice) for ll, choice in zip(lls, item["choices"])]
        acc += lls.index(max(lls)) == item["label"]
        acc_norm += norm.index(max(norm)) == item["label"]
    return acc / len(items), acc_norm / len(items)


@pytest.fixture(scope="module")
def harness(checkpoint, include_dir):
    from epas_megatron.evaluation.lm_eval_model import run_lm_eval

    return run_lm_eval(checkpoint, "0,max", [TASK], include_path=include_dir, batch_size=4)


def test_harness_accuracies_equal_the_hand_computation(harness, reference, items):
    assert [r["region"] for r in harness["regions"]] == [0, 2] and harness["trained_region"] == 2
    assert [r["sharing_layers"] for r in harness["regions"]] == [[], [2, 3]]
    for entry in harness["regions"]:
        metrics = entry["results"][TASK]
        acc, acc_norm = hand_accuracy(reference, items, entry["region"])
        assert (metrics["acc,none"], metrics["acc_norm,none"]) == (acc, acc_norm), entry["region"]
        assert entry["n_samples"][TASK]["effective"] == len(items)
        # stderr of a mean of 0/1 values: sqrt(p (1 - p) / (n - 1))
        assert metrics["acc_stderr,none"] == pytest.approx(math.sqrt(acc * (1 - acc) / (len(items) - 1)))


@pytest.mark.parametrize("region", [0, 2])
def test_loglikelihoods_match_the_reference(models, reference, items, region):
    requests = [(item["question"], " " + choice) for item in items for choice in item["choices"]]
    requests += [("", "Return the absolute value."),          # empty context: EOS
                 ("  ", "Return None."),                          # empty once the spaces moved: EOS
                 ("Return the absolute ", "value of a number."),  # trailing space moves
                 (LONG_TEXT, " Return None.")]                  # longer than the context: left-truncated
    assert len(reference.tokenizer.tokenize(LONG_TEXT)) > MAX_LENGTH
    ours = models[region].loglikelihood(requests)  # batches of 3, longest first, order restored
    for request, (logprob, greedy) in zip(requests, ours):
        expected, expected_greedy = reference.loglikelihood(*request, region)
        assert logprob == pytest.approx(expected, abs=1e-4), request
        assert greedy == expected_greedy
    # The region is real: the other region's model scores differently.
    other = models[2 - region].loglikelihood(requests[:3])
    assert all(abs(a[0] - b[0]) > 1e-4 for a, b in zip(ours[:3], other))


def test_rolling_loglikelihood_over_windows_matches_the_reference(models, reference):
    tokens = len(reference.tokenizer.tokenize(LONG_TEXT))
    assert tokens > 2 * MAX_LENGTH  # three windows, the last one partial
    for region, model in models.items():
        (total,) = model.loglikelihood_rolling([(LONG_TEXT,)])
        assert total == pytest.approx(reference.rolling(LONG_TEXT, region), abs=1e-3)


def test_generate_until_stops_at_the_stop_string(models):
    model = models[2]
    prompt = "Return the absolute value of"
    ids = model.tokenizer.tokenize(prompt)
    expected = model.generator.generate([ids], max_new_tokens=12)[0]
    text = model.tokenizer.detokenize(expected.tokens[:-1] if expected.finish_reason == "eos" else expected.tokens)
    assert len(text) >= 4, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    outputs = model.generate_until([(prompt, {"until": [stop], "max_gen_toks": 12}),
                                    (prompt, {"until": ["never appears"], "max_gen_toks": 12, "do_sample": False})])
    assert outputs == [text[:text.index(stop)], text]


def test_cli_prints_one_table_with_a_column_per_region(checkpoint, include_dir, harness, capsys, tmp_path):
    output = tmp_path / "lm_eval.json"
    code = main(["--load", str(checkpoint), "--regions", "0,max", "--lm-eval-tasks", TASK,
                 "--lm-eval-include-path", str(include_dir), "--lm-eval-batch-size", "4", "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "| task | metric | region 0 | region 2 |" in captured.out
    assert any(line.startswith(f"| {TASK} | acc_norm | ") for line in captured.out.splitlines())
    payload = json.loads([l for l in captured.out.splitlines() if l.startswith("LM_EVAL ")][-1][len("LM_EVAL "):])
    assert payload == json.loads(output.read_text())
    assert [r["results"] for r in payload["regions"]] == [r["results"] for r in harness["regions"]]


def test_cli_bad_input_is_one_error_line(checkpoint, include_dir, capsys, monkeypatch):
    base = ["--load", str(checkpoint), "--regions", "0", "--lm-eval-tasks", TASK, "--lm-eval-include-path", str(include_dir)]

    def error(*extra):
        code = main([*base, *extra])
        err = capsys.readouterr().err.strip()
        assert code == 2 and err.startswith("error: ") and "\n" not in err, err
        return err

    assert "--tp 2: --lm-eval-tasks runs with TP = PP = 1" in error("--tp", "2")
    assert "--lm-eval-limit 0: must be >= 1" in error("--lm-eval-limit", "0")
    assert "--lm-eval-tasks: unknown task 'no_such_task'" in error("--lm-eval-tasks", f"{TASK},no_such_task")
    code = main(["--load", str(checkpoint), "--regions", "0", "--lm-eval-limit", "3"])
    assert code == 2 and "--lm-eval-limit needs --lm-eval-tasks" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "start epas-eval without torchrun" in error()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed
    assert "pip install lm-eval" in error()


def test_markdown_table_rows_columns_and_average():
    from epas_megatron.evaluation.lm_eval_model import markdown_table

    def region(r, a, b, ppl):
        return {"region": r, "results": {
            "a": {"alias": "a", "acc,none": a, "acc_stderr,none": 0.1, "acc_norm,none": a / 2, "acc_norm_stderr,none": "N/A"},
            "b": {"alias": "b", "acc,none": b, "acc_stderr,none": 0.2},
            "wiki": {"alias": "wiki", "word_perplexity,none": ppl, "word_perplexity_stderr,none": "N/A"}}}

    table = markdown_table({"trained_region": 2, "tasks": ["a", "b", "wiki"],
                            "regions": [region(0, 0.5, 0.25, 12.5), region(3, 0.75, 0.5, 2500.0)]})
    assert table.splitlines() == [
        "| task | metric | region 0 | region 3 (untrained) |",
        "|---|---|---|---|",
        "| a | acc | 0.5000 ± 0.1000 | 0.7500 ± 0.1000 |",
        "| a | acc_norm | 0.2500 | 0.3750 |",
        "| b | acc | 0.2500 ± 0.2000 | 0.5000 ± 0.2000 |",
        "| wiki | word_perplexity | 12.5000 | 2500.0 |",
        "| average (2 tasks) | acc | 0.3750 | 0.6250 |",
    ]


def test_lm_evals_own_command_line_with_the_epas_model(checkpoint, include_dir, reference, items, tmp_path):
    """``python -m epas_megatron.evaluation.lm_eval_model --model epas ...`` (README), as a
    command: lm_eval's own command line parses the model arguments and writes its results file,
    whose accuracies at region 2 are the hand computation's."""
    import subprocess

    from epas_testing import child_environ

    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.evaluation.lm_eval_model", "--model", "epas", "--model_args",
                           f"load={checkpoint},region=2", "--tasks", TASK, "--include_path", str(include_dir), "--batch_size", "4",
                           "--output_path", str(out)], capture_output=True, text=True, timeout=600,
                          env={**child_environ(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = out.rglob("results*.json")
    metrics = json.loads(results_file.read_text())["results"][TASK]
    assert (metrics["acc,none"], metrics["acc_norm,none"]) == hand_accuracy(reference, items, 2)


def test_num_fewshot_reaches_the_harness(checkpoint, include_dir, capsys):
    """--lm-eval-num-fewshot 2 reaches the harness: lm_eval reports 2 shots for the task (0
    without the flag, the task's own default)."""
    def run(*extra):
        code = main(["--load", str(checkpoint), "--regions", "max", "--lm-eval-tasks", TASK, "--lm-eval-include-path",
                     str(include_dir), "--lm-eval-batch-size", "4", *extra])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        (region,) = json.loads([l for l in captured.out.splitlines() if l.startswith("LM_EVAL ")][-1][len("LM_EVAL "):])["regions"]
        return region

    zero, two = run(), run("--lm-eval-num-fewshot", "2")
    assert zero["n_shot"][TASK] == 0 and two["n_shot"][TASK] == 2
