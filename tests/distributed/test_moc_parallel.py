"""Mixture-of-Channels MLPs (--moc-topk) in training: the same model under TP=2 (with and without
sequence parallelism) and PP=2 with the split-backward V-Min schedule as in one process; EPAS
switches on; bf16 learns; and the choice is stored with the checkpoint (a resume with another
--moc-topk is refused)."""

import pytest

from epas_testing import TINY, assert_close, run_trainer

pytestmark = pytest.mark.distributed

# tiny: ffn 176 -> 4 groups of 44 channels, 11 kept per token and group (topk 0.25).
ARGS = [*TINY, "--train-iters", "6", "--global-batch-size", "4", "--micro-batch-size", "1", "--moc-topk", "0.25",
        "--moc-groups", "4", "--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "3", "--seed", "7",
        "--init-method-std", "0.2", "--no-save-final"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_trainer(ARGS, tmp_path_factory.mktemp("moc") / "run")


def test_moc_is_another_model(reference, tmp_path):
    dense = run_trainer([*ARGS, "--moc-topk", "1"], tmp_path / "dense")
    assert all(dense.losses[i] != reference.losses[i] for i in range(1, 7))
    assert "Mixture-of-Channels" in reference.stdout


@pytest.mark.parametrize("extra", [["--tp", "2"], ["--tp", "2", "--sequence-parallel"],
                                   ["--pp", "2", "--pipeline-schedule", "v-min"]], ids=["tp2", "tp2_sp", "pp2_v_min"])
def test_layouts_equal_one_process(reference, tmp_path, extra):
    """Channel groups never straddle a TP shard: TP=2 picks the same channels; V-Min defers
    linear_fc2's weight gradient of the sparse MLP to its W pass."""
    run = run_trainer([*ARGS, *extra], tmp_path / "run", nproc=2)
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    assert_close(run.losses, reference.losses, 1e-5, "loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-5, "grad norm")


def test_bf16_with_switches_learns_and_the_checkpoint_keeps_the_choice(tmp_path):
    args = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2", "--moc-topk", "0.25",
            "--moc-groups", "4", "--epas-target-layers", "2", "--epas-interval", "3", "--precision", "bf16", "--lr", "3e-3",
            "--save-interval", "6"]
    run = run_trainer(args, tmp_path / "run")
    assert run.losses[12] < run.losses[1] - 0.3, run.losses
    bad = run_trainer([*args, "--moc-topk", "0.5", "--load", str(tmp_path / "run" / "checkpoints")], tmp_path / "bad", check=False)
    assert bad.returncode != 0 and "--moc-topk" in bad.stdout + bad.stderr


def test_bad_groups_are_refused_before_any_work(tmp_path):
    run = run_trainer([*ARGS, "--moc-groups", "11", "--tp", "2"], tmp_path / "run", nproc=2, check=False)
    assert run.returncode != 0 and "--moc-groups 11 must be a multiple of --tp 2" in run.stdout + run.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("recompute", [["--recompute", "selective", "--recompute-modules", "core_attn", "mlp"],
                                       ["--recompute", "full", "--recompute-num-layers", "1"]], ids=["selective_mlp", "full"])
def test_recompute_replays_the_same_channels(reference, tmp_path, recompute):
    """Recomputing a MoC MLP (its own checkpoint, or whole layers) runs the Top-K again on the same
    gate values: the losses and gradient norms of the run without recompute."""
    run = run_trainer([*ARGS, *recompute], tmp_path / "run")
    assert_close(run.losses, reference.losses, 1e-6, "loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-6, "grad norm")


def test_epas_eval_of_a_moc_checkpoint_equals_its_validation_in_training(tmp_path, capsys):
    """epas-eval rebuilds the Mixture-of-Channels MLPs from the checkpoint's config: its loss at
    the trained region equals the trainer's validation of the same weights (a dense MLP on them
    gives other logits: tests/hf_export/test_moc_export.py)."""
    import json

    from epas_megatron.evaluate import main as epas_eval

    args = [a for a in ARGS if a != "--no-save-final"]
    run = run_trainer([*args, "--eval-interval", "6", "--eval-iters", "2"], tmp_path / "run")
    in_training = [m["lm_loss"] for m in run.metrics if m.get("kind") == "valid" and m["iteration"] == 6 and m.get("in_training", True)]
    code = epas_eval(["--load", str(tmp_path / "run" / "checkpoints"), "--regions", "max", "--eval-iters", "2"])
    out = capsys.readouterr()
    assert code == 0, out.err
    loss = json.loads([l for l in out.out.splitlines() if l.startswith("EVAL ")][-1][5:])["results"][0]["lm_loss"]
    assert loss == pytest.approx(in_training[0], rel=1e-6)
