"""A build option is its module, its config section and a registry line (epas_megatron/build_option.py,
model/option_registry.py): a dummy option with only those three (tests/build_option_dummy.py: an
MLP whose output is scaled) parses from the command line, checks its own flag, rides on the build
plan, configures every layer spec and is saved with the run's config (it trains, through in-memory
switches: tests/training/test_build_option_run.py).

The reference for what it builds is independent of the option: the plain model from the same seed
with every ``linear_fc2`` weight scaled by hand (the MLP has no bias, so scaling its output is
scaling that weight)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from build_option_dummy import MLPScale, built_scales, enrolled
from epas_megatron.errors import ConfigError
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.builder import build_model
from epas_megatron.model.option_registry import BUILD_OPTIONS, build_options, enrol, withdraw
from epas_megatron.runtime.wrapping import unwrap_model
from epas_testing import TINY


@pytest.fixture(name="option")
def _option():
    with enrolled():
        yield MLPScale


@pytest.mark.usefixtures("single_process")
def test_the_option_builds_what_hand_scaled_weights_compute(tiny_arch):
    scale = 0.375
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)

    def logits(plan):
        model = build_model(plan, seed=11).chunks[0].eval()
        with torch.no_grad():
            return model, model(tokens, positions, None)

    for sharing in ((), (2, 3)):
        plain = BuildPlan.for_region(tiny_arch, sharing, seq_length=16)
        scaled_model, scaled = logits(replace(plain, options=(MLPScale(scale),)))
        reference_model, unscaled = logits(plain)
        assert built_scales(scaled_model) == [scale] * 4 and built_scales(reference_model) == [None] * 4
        assert not torch.allclose(scaled, unscaled, atol=1e-3)  # the control: the option changes the model
        with torch.no_grad():
            for layer in unwrap_model(reference_model).decoder.layers:
                layer.mlp.linear_fc2.weight.mul_(scale)
            reference = reference_model(tokens, positions, None)
        torch.testing.assert_close(scaled, reference, rtol=1e-5, atol=1e-5)


def test_the_registry_enrols_the_section_and_the_option(option):
    from epas_megatron.config.cli import from_dict, parse_config, to_dict
    from epas_megatron.validation import resolve_run

    assert BUILD_OPTIONS[-1] is MLPScale
    cfg = parse_config([*TINY, "--test-mlp-scale", "0.5"])
    assert cfg.test_mlp_scale_option.test_mlp_scale == 0.5
    assert build_options(cfg) == (MLPScale(0.5),) and build_options(parse_config(TINY)) == ()
    saved = to_dict(cfg)
    assert saved["test_mlp_scale_option"] == {"test_mlp_scale": 0.5}
    assert from_dict(saved).test_mlp_scale_option.test_mlp_scale == 0.5  # a checkpoint's config reads back
    with pytest.raises(ConfigError, match="--test-mlp-scale must be >= 0"):
        resolve_run(parse_config([*TINY, "--test-mlp-scale", "-1"]), world_size=1, cuda=False)
    with pytest.raises(ValueError, match="enrolled already"):
        enrol(replace_name(MLPScale))


def replace_name(option):
    """Another option class under the same name."""
    return type("Other", (option,), {})


def test_a_withdrawn_option_is_off(option):
    from epas_megatron.config.cli import parse_config

    withdraw(MLPScale)
    try:
        assert build_options(parse_config([*TINY, "--test-mlp-scale", "0.5"])) == ()
    finally:
        enrol(MLPScale)


def test_the_packages_options_come_from_their_flags():
    """MoC, Random-LTD and the switch ramp are build options: each is on exactly when its flag says,
    and a checkpoint's model for evaluation (training=False) keeps only what changes its layers'
    math at inference (MoC), not the training-only ones."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.model.blending import SwitchRampSettings
    from epas_megatron.model.moc_sizes import MoCSettings
    from epas_megatron.random_ltd.option import RandomLTDSettings

    epas = ["--epas-target-layers", "2", "--epas-interval", "4"]
    cfg = parse_config([*TINY, *epas, "--moc-topk", "0.5", "--random-ltd", "--random-ltd-layers", "1,2", "--epas-switch-ramp", "2"])
    assert build_options(cfg) == (MoCSettings(0.5, 8), RandomLTDSettings((1, 2), seed=cfg.training.seed, kernels="auto"),
                                  SwitchRampSettings(2))
    assert build_options(cfg, training=False) == (MoCSettings(0.5, 8),)
    assert build_options(parse_config([*TINY, "--epas-switch-ramp", "2"])) == ()  # EPAS off: nothing ramps
    assert build_options(parse_config([*TINY, *epas])) == ()
