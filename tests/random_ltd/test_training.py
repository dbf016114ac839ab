"""Random-LTD training (with EPAS switching on): layout-independent (TP=2, PP=2 x VPP=2, DP=2 with
the distributed optimizer equal the single process), resumed bit-identically, LayerToken LR, and
throughput from the FLOPs the kept tokens cost."""

import pytest

from epas_testing import TINY, assert_close, model_shape, run_trainer

# seq 64: kept 4, 16, 32, 48 tokens (floor(k/4 * 60 + 4) rounded down to a multiple of 4) at iterations 1-4, then all 64.
# Switches at 3 (layer 3) and 5 (2-3).
BASE = [*TINY, "--train-iters", "6", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "3",
        "--lr-warmup-iters", "2", "--seed", "7", "--init-method-std", "0.2"]
ARGS = [*BASE, "--random-ltd", "--random-ltd-layers", "0-3", "--random-ltd-require-steps", "4", "--random-ltd-seq-per-step", "4"]
KEPT = {1: 4, 2: 16, 3: 32, 4: 48, 5: 64, 6: 64}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_trainer([*ARGS, "--no-save-final"], tmp_path_factory.mktemp("single") / "run")


def records(run):
    return {m["iteration"]: m for m in run.metrics if "kind" not in m}


def test_schedule_lr_and_flops_of_the_run(reference):
    from epas_megatron.metrics.flops import Convention, layerwise_forward_flops

    recs = records(reference)
    assert {i: r["random_ltd_kept_tokens"] for i, r in recs.items()} == KEPT
    # LayerToken LR: peak after the warm-up's layer tokens (iteration 2), min_lr at the end.
    assert recs[2]["lr"] == pytest.approx(3e-4) and recs[6]["lr"] == pytest.approx(3e-5)
    # Layer tokens: DeepSpeed's count, layers 0-3 all dropping.
    assert recs[6]["consumed_layer_tokens"] == 4 * 4 * sum(KEPT.values())
    # TFLOP/s from the FLOPs each iteration ran: kept tokens in dropping layers, whose source of
    # the sharing region (layer 2 at iterations 3-4, layer 1 from 5) projects Q/K/V for all 64.
    shape = model_shape(4, 64, 4, 2, 176, 512, 64)
    for i, rec in recs.items():
        modes = ["compute"] * 4
        source = None
        if i >= 3:
            modes[3] = "share_qk"
            source = 2
        if i >= 5:
            modes[2] = "share_qk"
            source = 1
        tokens = [KEPT[i]] * 4
        qkv = [64 if layer == source else KEPT[i] for layer in range(4)]
        expected = 3 * 4 * layerwise_forward_flops(shape, modes, tokens, Convention.MEGATRON, qkv)
        logged = rec["tflops_per_device"] * 1e12 * rec["iteration_time_s"]
        assert logged == pytest.approx(expected, rel=1e-9), i
    assert recs[1]["tokens_per_s"] * recs[1]["iteration_time_s"] == pytest.approx(4 * 64)  # every input token counts


def test_keeping_every_token_is_plain_training(reference, tmp_path):
    """min = max = the sequence: Random-LTD's machinery runs but drops nothing, and the LayerToken
    LR (constant layer tokens per step) is the iteration schedule: bit-identical to a plain run."""
    plain = run_trainer([*BASE, "--no-save-final"], tmp_path / "plain")
    keep_all = run_trainer([*BASE, "--no-save-final", "--random-ltd", "--random-ltd-min-value", "64"], tmp_path / "all")
    assert keep_all.losses == plain.losses and keep_all.grad_norms == plain.grad_norms
    assert all(plain.losses[i] != reference.losses[i] for i in range(1, 7))


@pytest.mark.distributed
@pytest.mark.parametrize("extra", [["--tp", "2"], ["--pp", "2", "--vpp", "2", "--epas-rebalance", "off"], ["--use-distributed-optimizer"],
                                   ["--pp", "2", "--pipeline-schedule", "v-min"]],
                         ids=["tp2", "pp2_vpp2", "dp2_distributed_optimizer", "pp2_v_min"])
def test_layout_independent(reference, tmp_path, extra):
    """Kept tokens are keyed by sample and layer, so every layout drops the same tokens."""
    run = run_trainer([*ARGS, *extra, "--no-save-final"], tmp_path / "run", nproc=2)
    assert_close(run.losses, reference.losses, 1e-5, "loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-5, "grad norm")


def test_resume_is_bit_identical(reference, tmp_path):
    out = tmp_path / "run"
    first = run_trainer([*ARGS, "--exit-interval", "3"], out)
    assert first.summary["iterations"] == 3
    second = run_trainer([*ARGS, "--load", str(out / "checkpoints")], out)
    assert second.losses == reference.losses and second.grad_norms == reference.grad_norms
    # Other Random-LTD flags cannot resume this checkpoint.
    bad = run_trainer([*ARGS, "--random-ltd-require-steps", "5", "--load", str(out / "checkpoints" / "iter_0000003")],
                      tmp_path / "bad", check=False)
    assert bad.returncode != 0 and "--random-ltd-*" in bad.stdout + bad.stderr
