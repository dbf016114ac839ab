"""A dummy build option (tests/build_option_dummy.py: only its module, config section and registry
line) trains through the real trainer: nothing in the trainer, the assembly or the builder names it."""

from __future__ import annotations

import pytest
import yaml

from build_option_dummy import built_scales, enrolled
from epas_megatron.config.cli import parse_config
from epas_megatron.errors import ConfigError
from epas_megatron.training.trainer import Trainer
from epas_megatron.validation import resolve_run
from epas_testing import TINY, train_in_process


def test_a_run_trains_with_the_option_through_a_switch_and_resumes_only_with_it(tmp_path):
    """The trainer gets it from the registry (nothing in the trainer, assembly or builder names it):
    in bf16, every layer of the model each in-memory switch builds carries it (what the option
    builds is checked against a hand-scaled reference in tests/model/test_build_options.py); the
    run's config records it; the loss falls. A resume with another value of its flag, or without
    it, is refused before anything is built, naming the flag; with the same value it is accepted."""
    seen = []

    def after_load(trainer, what):
        seen.extend((what, scale) for chunk in trainer.model for scale in built_scales(chunk))

    args = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "3",
            "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--no-tensorboard",
            "--epas-target-layers", "2", "--epas-interval", "3", "--precision", "bf16"]
    with enrolled():
        run = train_in_process([*args, "--test-mlp-scale", "0.5"], tmp_path / "run", after_load=after_load)
        assert run.returncode == 0, run.stdout[-2000:]
        resume = [*args, "--load", str(tmp_path / "run" / "checkpoints"), "--train-iters", "10"]
        for n, other in enumerate((["--test-mlp-scale", "0.25"], [])):
            with pytest.raises(ConfigError, match=r"--test-mlp-scale: the checkpoint was trained with MLPScale\(scale=0.5\)"):
                Trainer(resolve_run(parse_config([*resume, *other, "--output-dir", str(tmp_path / f"refused{n}")]), world_size=1))
        Trainer(resolve_run(parse_config([*resume, "--test-mlp-scale", "0.5", "--output-dir", str(tmp_path / "same")]), world_size=1))
    assert seen == [("switch", 0.5)] * 8  # two switches, four layers each
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["test_mlp_scale_option"] == {"test_mlp_scale": 0.5}
    losses = [run.losses[i] for i in sorted(run.losses)]
    assert losses[-1] < losses[0] - 0.1, losses
