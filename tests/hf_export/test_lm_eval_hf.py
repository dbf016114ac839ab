"""lm-evaluation-harness's own ``hf`` model, loading the export with ``trust_remote_code=True``
(the shipped modeling code and tokenizer), scores the shipped offline task as ``epas-eval
--lm-eval-tasks`` scores the checkpoint: the same accuracies, and the same log-likelihood for
every request (the harness's per-sample records against ``EpasLM.loglikelihood``)."""

from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[1] / "evaluation" / "tasks"
TASK = "epas_tiny_mc"


@pytest.fixture(scope="module")
def include_dir(tmp_path_factory):
    """The task YAML with its data file's absolute path (lm_eval resolves it against the cwd)."""
    path = tmp_path_factory.mktemp("tasks")
    (path / f"{TASK}.yaml").write_text((TASKS / f"{TASK}.yaml.in").read_text().replace("@DATA_DIR@", str(TASKS)))
    return path


def test_the_hf_model_on_the_export_scores_like_epas_eval(checkpoint, exported, include_dir):
    import lm_eval
    import lm_eval.models.huggingface  # noqa: F401  (registers the harness's 'hf' model)

    from epas_megatron.evaluation.lm_eval_model import EpasLM, run_lm_eval, task_manager_for
    from epas_megatron.inference.generator import Generator
    from epas_megatron.runtime.distributed import destroy_distributed

    ours = run_lm_eval(checkpoint, "max", [TASK], include_path=include_dir, batch_size=4)
    assert [r["region"] for r in ours["regions"]] == [2]
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported},trust_remote_code=True,dtype=float32,max_length=64",
        tasks=[TASK], task_manager=task_manager_for([TASK], include_dir), batch_size=4, device="cpu", log_samples=True)
    for metric in ("acc,none", "acc_norm,none"):
        assert theirs["results"][TASK][metric] == ours["regions"][0]["results"][TASK][metric], metric

    samples = theirs["samples"][TASK]
    requests = [tuple(arg) for sample in samples for arg in sample["arguments"]]
    harness = [tuple(resp[0]) for sample in samples for resp in sample["resps"]]
    try:
        model = EpasLM(generator=Generator.from_checkpoint(checkpoint, region=2), batch_size=4)
        expected = model.loglikelihood(requests)
    finally:
        destroy_distributed()
    assert len(requests) == 30
    for request, (logprob, greedy), (expected_logprob, expected_greedy) in zip(requests, harness, expected):
        assert logprob == pytest.approx(expected_logprob, abs=1e-4), request
        assert greedy == expected_greedy

