"""bf16 and fp16 training with EPAS switches, on CPU (the same code paths a GPU runs).

References are independent of the code under test: the fp32 run for the trajectory, the
weights and optimizer state before a switch for what the switch must carry, an uninterrupted
run for resumes, and a hand implementation of Megatron's dynamic loss-scaling rule.
"""

import pytest
import torch

from epas_testing import TINY, run_trainer

# Switches at iterations 3, 6 and 9 (regions [3], [2, 3], [1, 2, 3]).
ARGS = [*TINY, "--train-iters", "12", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--epas-target-layers", "3", "--epas-interval", "3", "--seed", "3", "--init-method-std", "0.1",
        "--lr", "3e-3", "--lr-warmup-iters", "2"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return run_trainer([*ARGS, "--precision", "fp32"], tmp_path_factory.mktemp("fp32") / "run")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return run_trainer([*ARGS, "--precision", "bf16", "--save-interval", "1", "--keep-last", "0"],
                       tmp_path_factory.mktemp("bf16") / "run")


def test_bf16_tracks_fp32_through_switches_and_learns(fp32, bf16):
    assert [s["iteration"] for s in bf16.switches] == [3, 6, 9]
    assert bf16.summary["precision"] == "bf16"
    for iteration, loss in fp32.losses.items():
        # bf16 weights and activations: about 3 significant digits.
        assert abs(bf16.losses[iteration] - loss) <= 2e-2 * loss, (iteration, bf16.losses[iteration], loss)
    assert bf16.losses[1] != fp32.losses[1]  # it really ran in bf16
    assert bf16.losses[12] < bf16.losses[1] - 0.1


@pytest.mark.parametrize("iteration", [5, 6], ids=["before_switch", "after_switch"])
def test_bf16_resume_around_a_switch_is_bit_identical(bf16, tmp_path, iteration):
    """The fp32 main weights (not the bf16 model weights) are what a resume restores."""
    ckpt = bf16.output_dir / "checkpoints" / f"iter_{iteration:07d}"
    run = run_trainer([*ARGS, "--precision", "bf16", "--load", str(ckpt)], tmp_path / "run")
    assert run.losses == {k: v for k, v in bf16.losses.items() if k > iteration}
    assert run.grad_norms == {k: v for k, v in bf16.grad_norms.items() if k > iteration}


def _main_params(trainer) -> dict:
    """id(model parameter) -> its fp32 main parameter in the mixed-precision optimizer."""
    out = {}
    for opt in trainer.optimizer.chained_optimizers:
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            out.update({id(p): m for p, m in zip(model_group, main_group)})
    return out


def test_bf16_switch_carries_fp32_main_weights_exactly(tmp_path):
    from epas_megatron.config.cli import parse_config
    from epas_megatron.model.attention import split_qkv_rows
    from epas_megatron.runtime.wrapping import unwrap_model
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    trainer = Trainer(resolve_run(parse_config([*ARGS, "--precision", "bf16", "--exit-interval", "5",
                                                "--output-dir", str(tmp_path / "run")]), world_size=1))
    trainer.setup()
    try:
        trainer.train()  # iterations 1-5: region [3]
        model = unwrap_model(trainer.model[0])
        main = _main_params(trainer)
        qkv = model.decoder.layers[2].self_attention.linear_qkv.weight
        assert qkv.dtype == torch.bfloat16 and main[id(qkv)].dtype == torch.float32
        main_qkv = main[id(qkv)].detach().clone()
        assert not torch.equal(main_qkv, qkv.float())  # the main weights hold more than bf16 does
        others = {name: main[id(p)].detach().clone() for name, p in model.named_parameters()
                  if id(p) in main and "layers.2.self_attention.linear_qkv" not in name}

        trainer.apply_switch((2, 3))  # layer 2 starts sharing
        model = unwrap_model(trainer.model[0])
        main = _main_params(trainer)
        attention = model.decoder.layers[2].self_attention
        v_rows = split_qkv_rows(main_qkv, ("q", "k", "v"), 2, 2, 16)["v"]
        assert torch.equal(main[id(attention.linear_v.weight)], v_rows)
        assert id(attention.linear_qk.weight) not in main  # frozen: no main copy, no optimizer state
        for name, p in model.named_parameters():
            if name in others:
                assert torch.equal(main[id(p)], others[name]), name
    finally:
        trainer.close()


def _scales_by_hand(initial: float, hysteresis: int, window: int, overflowed: list[bool]) -> list[float]:
    """Megatron-LM's dynamic loss scaling, written out: the scale used at each step."""
    scale, hysteresis_left, clean = initial, hysteresis, 0
    used = []
    for found_inf in overflowed:
        used.append(scale)
        if found_inf:
            clean, hysteresis_left = 0, hysteresis_left - 1
            if hysteresis_left <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            clean += 1
            if clean == window:
                clean, hysteresis_left, scale = 0, hysteresis, scale * 2.0
    return used


def test_fp16_dynamic_loss_scale_continues_through_switches(tmp_path):
    """Start with a scale that overflows for several steps across two switches: the scale keeps
    halving as the rule says (the scaler's state crosses each switch), then training proceeds."""
    run = run_trainer([*ARGS, "--precision", "fp16", "--initial-loss-scale", str(2.0**20), "--loss-scale-window", "4"],
                      tmp_path / "run")
    records = sorted(run.train_records, key=lambda r: r["iteration"])
    skipped = [r["skipped_iterations"] for r in records]
    overflowed = [b > a for a, b in zip([0] + skipped[:-1], skipped)]
    assert overflowed[:4] == [True] * 4 and not all(overflowed)  # overflows across the switch at 3, then learns
    expected = _scales_by_hand(2.0**20, 2, 4, overflowed)
    assert [r["loss_scale"] for r in records] == expected
    assert [s["iteration"] for s in run.switches] == [3, 6, 9]


def test_fp16_with_unit_scale_tracks_fp32(fp32, tmp_path):
    run = run_trainer([*ARGS, "--precision", "fp16", "--loss-scale", "1"], tmp_path / "run")
    assert run.summary["skipped_iterations"] == 0
    for iteration, loss in fp32.losses.items():
        assert abs(run.losses[iteration] - loss) <= 5e-3 * loss, (iteration, run.losses[iteration], loss)


def test_fp16_resume_keeps_the_loss_scale(tmp_path):
    args = [*ARGS, "--precision", "fp16", "--initial-loss-scale", str(2.0**20), "--loss-scale-window", "4"]
    whole = run_trainer([*args, "--save-interval", "1", "--keep-last", "0"], tmp_path / "whole")
    resumed = run_trainer([*args, "--load", str(whole.output_dir / "checkpoints" / "iter_0000007")], tmp_path / "part")
    later = {r["iteration"]: r["loss_scale"] for r in whole.train_records if r["iteration"] > 7}
    assert {r["iteration"]: r["loss_scale"] for r in resumed.train_records} == later
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 7}
