"""--epas-switch-ramp in training: the ramp's weights per iteration (worked out by hand) reach the
metrics, the switches stay at their iterations, the ramp changes the losses from its first step on
(and not before); N = 0 is the run without the flag, bit for bit; a resume inside a ramp continues
the uninterrupted run exactly, in fp32, bf16 and fp16, and the model learns; a resume with another
value is refused."""

import pytest

from epas_testing import TINY, run_trainer

# Switches at iterations 4 (layer 3) and 8 (layer 2); N = 2: iterations 2, 3 and 6, 7 blend with a = 1/2, 1.
BASE = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr-warmup-iters", "3",
        "--epas-target-layers", "2", "--epas-interval", "4", "--seed", "5", "--init-method-std", "0.1"]
WEIGHT = {2: 0.5, 3: 1.0, 6: 0.5, 7: 1.0}
RAMP = [*BASE, "--epas-switch-ramp", "2"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return run_trainer([*BASE, "--no-save-final"], tmp_path_factory.mktemp("plain") / "run")


@pytest.fixture(scope="module")
def ramp(tmp_path_factory):
    return run_trainer([*RAMP, "--no-save-final"], tmp_path_factory.mktemp("ramp") / "run")


def test_the_ramp_runs_before_each_switch(plain, ramp):
    assert [r["switch_ramp_weight"] for r in ramp.train_records] == [WEIGHT.get(i, 0.0) for i in range(1, 13)]
    assert [s["iteration"] for s in ramp.switches] == [s["iteration"] for s in plain.switches] == [4, 8]
    assert "blended switches (--epas-switch-ramp 2)" in ramp.stdout and "iterations 2-3, 6-7" in ramp.stdout
    # The negative control: the first step is the plain run's, the first ramped step is not.
    assert ramp.losses[1] == plain.losses[1] and ramp.losses[2] != plain.losses[2]


def test_zero_is_the_run_without_the_flag(plain, tmp_path):
    off = run_trainer([*BASE, "--no-save-final", "--epas-switch-ramp", "0"], tmp_path / "run")
    assert off.losses == plain.losses and off.grad_norms == plain.grad_norms
    assert "switch_ramp_weight" not in off.train_records[0]


@pytest.mark.parametrize("precision", [[], ["--precision", "bf16"], ["--precision", "fp16", "--initial-loss-scale", "4096"]],
                         ids=["fp32", "bf16", "fp16"])
def test_resume_inside_a_ramp_is_bit_identical_and_learns(ramp, precision, tmp_path):
    whole = ramp if not precision else run_trainer([*RAMP, *precision, "--no-save-final"], tmp_path / "whole")
    out = tmp_path / "run"
    first = run_trainer([*RAMP, *precision, "--exit-interval", "6"], out)  # stops inside the second ramp (a = 1/2 done)
    assert first.summary["iterations"] == 6
    second = run_trainer([*RAMP, *precision, "--load", str(out / "checkpoints")], out)
    assert second.summary["iterations"] == 12
    resumed = range(7, 13)  # 7 still ramps (a = 1), 8 switches
    assert [second.losses[i] for i in resumed] == [whole.losses[i] for i in resumed]
    assert [second.grad_norms[i] for i in resumed] == [whole.grad_norms[i] for i in resumed]
    first_losses, last = sum(whole.losses[i] for i in (1, 2, 3)) / 3, sum(whole.losses[i] for i in (10, 11, 12)) / 3
    assert last < first_losses - 0.1, (first_losses, last)
    if not precision:  # another value, or none, on resume: refused before any work
        for flags, named in ((["--epas-switch-ramp", "1"], "--epas-switch-ramp 2, this run has --epas-switch-ramp 1"),
                             ([], "was trained with --epas-switch-ramp; resume with the same --epas-switch-ramp value")):
            bad = run_trainer([*BASE, *flags, "--load", str(out / "checkpoints" / "iter_0000006")], tmp_path / "bad", check=False)
            assert bad.returncode == 2 and named in bad.stderr, bad.stderr
