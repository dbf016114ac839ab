"""The README's training flags end to end through epas-train, each shown to take effect against
a run without it (the negative control) or an independent computation:

* ``--epas-detach-shared``: the sharing layers' gradients stop reaching the source's Q/K, so
  the run equals the attached one until the first step with a sharing layer has updated the
  weights, and differs after;
* ``--core-attention unfused``: Megatron's unfused attention instead of SDPA -- another kernel,
  the same losses (1e-5);
* an explicit ``--pipeline-layout`` over PP=2: the layout of every iteration, and the losses of
  the PP=1 run (1e-5);
* ``--no-random-ltd-layer-token-lr``: Random-LTD with the learning rate stepped by iterations is
  the plain run's learning rate at every iteration; the default (LayerToken LR) is not."""

import pytest

from epas_testing import TINY, assert_close, run_trainer

# Switches at 2 ([3]) and 4 ([2, 3]).
ARGS = [*TINY, "--train-iters", "6", "--global-batch-size", "4", "--micro-batch-size", "2", "--epas-target-layers", "2",
        "--epas-interval", "2", "--seed", "5", "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "1",
        "--no-save-final"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    run = run_trainer(ARGS, tmp_path_factory.mktemp("plain") / "run")
    assert [s["iteration"] for s in run.switches] == [2, 4] and sorted(run.losses) == list(range(1, 7))
    return run


def test_detach_shared_stops_the_gradient_into_the_source(plain, tmp_path):
    detached = run_trainer([*ARGS, "--epas-detach-shared"], tmp_path / "run")
    # Iterations 1-2: the same weights (the first sharing step's loss is computed before its update).
    assert [detached.losses[i] for i in (1, 2)] == [plain.losses[i] for i in (1, 2)]
    assert all(detached.losses[i] != plain.losses[i] for i in (3, 4, 5, 6))


def test_unfused_core_attention_is_another_kernel_with_the_same_losses(plain, tmp_path):
    unfused = run_trainer([*ARGS, "--core-attention", "unfused"], tmp_path / "run")
    assert "unfused attention" in unfused.stdout and "sdpa attention" in plain.stdout
    assert_close(unfused.losses, plain.losses, 1e-5, "unfused vs SDPA loss")
    assert_close(unfused.grad_norms, plain.grad_norms, 1e-4, "unfused vs SDPA grad norm")


@pytest.mark.distributed
def test_explicit_pipeline_layout_is_kept_and_equals_pp1(plain, tmp_path):
    layout = "Et|tttL"
    run = run_trainer([*ARGS, "--pp", "2", "--pipeline-layout", layout], tmp_path / "run", nproc=2)
    assert {r["layout"] for r in run.train_records} == {layout}
    assert_close(run.losses, plain.losses, 1e-5, "PP=2 explicit layout vs PP=1 loss")


def test_random_ltd_lr_by_iterations(plain, tmp_path):
    ltd = ["--random-ltd", "--random-ltd-layers", "0-3", "--random-ltd-require-steps", "4", "--random-ltd-seq-per-step", "4"]
    by_iterations = run_trainer([*ARGS, *ltd, "--no-random-ltd-layer-token-lr"], tmp_path / "iterations")
    by_layer_tokens = run_trainer([*ARGS, *ltd], tmp_path / "layer_tokens")
    lrs = lambda run: [r["lr"] for r in sorted(run.train_records, key=lambda r: r["iteration"])]  # noqa: E731
    assert lrs(by_iterations) == lrs(plain)
    assert lrs(by_layer_tokens) != lrs(plain)
