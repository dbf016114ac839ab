"""--epas-switch-rewarm in training: the logged learning rate is Megatron's (the same run without the
flag) times the hand-computed factor at every iteration, also under Random-LTD's LayerToken LR;
N = 0 is the run without the flag, bit for bit; a resume inside a re-warm window continues the
uninterrupted run exactly; a resume with another value is refused; the factor always multiplies the
scheduler's value afresh (idempotent, and right after a step whose LR count stood still)."""

import pytest

from epas_testing import TINY, run_trainer

# Switches at iterations 4 (layer 3) and 8 (layers 2-3); warm-up 3 iterations, cosine decay to 12.
BASE = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr-warmup-iters", "3",
        "--epas-target-layers", "2", "--epas-interval", "4", "--seed", "5", "--init-method-std", "0.1"]
# N = 2: the steps of iterations 4, 5 and 8, 9 run at 1/3 and 2/3 of the scheduler's LR (worked out by hand).
FACTOR = {4: 1 / 3, 5: 2 / 3, 8: 1 / 3, 9: 2 / 3}
REWARM = [*BASE, "--epas-switch-rewarm", "2"]


def lrs(run) -> dict[int, float]:
    return {m["iteration"]: m["lr"] for m in run.train_records}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_trainer([*BASE, "--no-save-final"], tmp_path_factory.mktemp("plain") / "run")


@pytest.fixture(scope="module")
def rewarm(tmp_path_factory):
    return run_trainer([*REWARM, "--no-save-final"], tmp_path_factory.mktemp("rewarm") / "run")


def test_the_logged_lr_is_megatrons_times_the_factor(plain, rewarm):
    # The lr logged after iteration i is the one the step of i + 1 uses (Megatron's convention).
    base, scaled = lrs(plain), lrs(rewarm)
    assert list(scaled) == list(range(1, 13)) and base[1] > 0
    for i in range(1, 13):
        assert scaled[i] == base[i] * FACTOR.get(i + 1, 1.0), i
    assert [r["lr_rewarm_factor"] for r in rewarm.train_records] == [FACTOR.get(i + 1, 1.0) for i in range(1, 13)]
    assert "LR re-warm after each switch (--epas-switch-rewarm 2)" in rewarm.stdout
    # The negative control: the losses agree up to the step of the switch (its loss comes before its
    # update) and differ from the next one on, the re-warmed update having changed the weights.
    assert {i: rewarm.losses[i] for i in range(1, 5)} == {i: plain.losses[i] for i in range(1, 5)}
    assert rewarm.losses[5] != plain.losses[5]
    assert [s["iteration"] for s in rewarm.switches] == [4, 8]


def test_zero_is_the_run_without_the_flag(plain, tmp_path):
    off = run_trainer([*BASE, "--no-save-final", "--epas-switch-rewarm", "0"], tmp_path / "run")
    assert off.losses == plain.losses and off.grad_norms == plain.grad_norms and lrs(off) == lrs(plain)
    assert "lr_rewarm_factor" not in off.train_records[0]


def test_resume_inside_a_window_is_bit_identical(rewarm, tmp_path):
    out = tmp_path / "run"
    first = run_trainer([*REWARM, "--exit-interval", "4"], out)  # stops after the switch's step, before 5 (2/3)
    assert first.summary["iterations"] == 4
    second = run_trainer([*REWARM, "--load", str(out / "checkpoints")], out)
    assert second.summary["iterations"] == 12
    assert second.losses == rewarm.losses and second.grad_norms == rewarm.grad_norms and lrs(second) == lrs(rewarm)
    # Another value, or none, on resume: refused before any work.
    for flags, named in ((["--epas-switch-rewarm", "1"], "--epas-switch-rewarm 2, this run has --epas-switch-rewarm 1"),
                         ([], "was trained with --epas-switch-rewarm; resume with the same --epas-switch-rewarm value")):
        bad = run_trainer([*BASE, *flags, "--load", str(out / "checkpoints" / "iter_0000004")], tmp_path / "bad", check=False)
        assert bad.returncode == 2 and named in bad.stderr, bad.stderr


def test_on_top_of_random_ltds_layer_token_lr(plain, tmp_path):
    ltd = [*BASE, "--no-save-final", "--random-ltd", "--random-ltd-require-steps", "6", "--random-ltd-seq-per-step", "4"]
    alone = run_trainer(ltd, tmp_path / "ltd")
    both = run_trainer([*ltd, "--epas-switch-rewarm", "2"], tmp_path / "both")
    assert lrs(alone) != lrs(plain)  # the schedule counts layer tokens, not iterations
    base, scaled = lrs(alone), lrs(both)
    for i in range(1, 13):
        assert scaled[i] == base[i] * FACTOR.get(i + 1, 1.0), i
    assert both.summary["random_ltd"]["consumed_layer_tokens"] == alone.summary["random_ltd"]["consumed_layer_tokens"]


def test_scale_lr_reads_the_scheduler_afresh():
    """The factor multiplies the scheduler's value at its current count, never the groups' current
    LR: after a step whose LR count stood still (a skipped fp16 step), factor 1 is the scheduler's
    LR again; None touches nothing."""
    import torch

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from epas_megatron.engine.step import scale_lr

    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.ones(2))]}, {"params": [torch.nn.Parameter(torch.ones(3))]}],
                                lr=1.0)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4, lr_decay_steps=10,
                                        lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant")
    scheduler.step(increment=2)
    base = [group["lr"] for group in optimizer.param_groups]
    assert base == [5e-4, 5e-4]  # 2 of 4 warm-up steps
    scale_lr(optimizer, scheduler, 1 / 3)
    assert [group["lr"] for group in optimizer.param_groups] == [5e-4 / 3, 5e-4 / 3]
    scale_lr(optimizer, scheduler, 1 / 3)  # idempotent: not (1/3)^2
    assert [group["lr"] for group in optimizer.param_groups] == [5e-4 / 3, 5e-4 / 3]
    scale_lr(optimizer, scheduler, None)
    assert [group["lr"] for group in optimizer.param_groups] == [5e-4 / 3, 5e-4 / 3]
    scale_lr(optimizer, scheduler, 1.0)  # no scheduler step in between: its value, exactly
    assert [group["lr"] for group in optimizer.param_groups] == base


@pytest.mark.parametrize("precision", [["--precision", "bf16"], ["--precision", "fp16", "--initial-loss-scale", "4096"]],
                         ids=["bf16", "fp16"])
def test_half_precision_resume_inside_a_window_learns_and_is_bit_identical(precision, tmp_path):
    """In bf16 and fp16 (the mixed-precision optimizer's groups; fp16 with a dynamic loss scale)
    the re-warm scales the LR the uninterrupted run used, a resume inside a window continues it
    exactly, and the model learns. bf16 also against its own run without the flag: Megatron's LR
    times the hand-computed factor (fp16's skipped steps would shift the schedule between them)."""
    whole = run_trainer([*REWARM, *precision, "--no-save-final"], tmp_path / "whole")
    out = tmp_path / "run"
    run_trainer([*REWARM, *precision, "--exit-interval", "4"], out)
    second = run_trainer([*REWARM, *precision, "--load", str(out / "checkpoints")], out)
    assert second.summary["iterations"] == 12
    resumed = range(5, 13)  # the steps after the stop: 5 still inside the first window (2/3), 8 and 9 in the second
    assert [second.losses[i] for i in resumed] == [whole.losses[i] for i in resumed]
    assert [second.grad_norms[i] for i in resumed] == [whole.grad_norms[i] for i in resumed]
    assert [lrs(second)[i] for i in resumed] == [lrs(whole)[i] for i in resumed]
    first, last = sum(whole.losses[i] for i in (1, 2, 3)) / 3, sum(whole.losses[i] for i in (10, 11, 12)) / 3
    assert last < first - 0.1, (first, last)
    if precision[1] == "bf16":
        base = lrs(run_trainer([*BASE, *precision, "--no-save-final"], tmp_path / "plain"))
        assert all(lrs(whole)[i] == base[i] * FACTOR.get(i + 1, 1.0) for i in range(1, 13))
