"""A dummy build option (tests/build_option_dummy.py: only its module, config section and registry
line) trains through the real trainer: nothing in the trainer, the assembly or the builder names it."""

from __future__ import annotations

import yaml

from build_option_dummy import built_scales, enrolled
from epas_testing import TINY, train_in_process


def test_a_run_trains_with_the_option_through_a_switch(tmp_path):
    """The trainer gets it from the registry (nothing in the trainer, assembly or builder names it):
    every layer of the model each in-memory switch builds carries it (what the option builds is
    checked against a hand-scaled reference in tests/model/test_build_options.py); the run's config
    records it; the loss falls."""
    seen = []

    def after_load(trainer, what):
        seen.extend((what, scale) for chunk in trainer.model for scale in built_scales(chunk))

    args = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "3",
            "--init-method-std", "0.1", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--no-tensorboard",
            "--epas-target-layers", "2", "--epas-interval", "3", "--test-mlp-scale", "0.5"]
    with enrolled():
        run = train_in_process(args, tmp_path / "run", after_load=after_load)
    assert run.returncode == 0, run.stdout[-2000:]
    assert seen == [("switch", 0.5)] * 8  # two switches, four layers each
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["test_mlp_scale_option"] == {"test_mlp_scale": 0.5}
    losses = [run.losses[i] for i in sorted(run.losses)]
    assert losses[-1] < losses[0] - 0.1, losses
