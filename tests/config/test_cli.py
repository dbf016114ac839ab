"""Flags, YAML and presets combine with precedence defaults < preset < YAML < flags."""

import pytest

from epas_megatron.config.cli import build_parser, dump_yaml, from_dict, parse_config, to_dict
from epas_megatron.config.presets import PRESETS, default_ffn_hidden_size
from epas_megatron.errors import ConfigError


def test_every_field_is_a_flag_with_help():
    parser = build_parser()
    flags = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    for flag in ("--train-iters", "--micro-batch-size", "--global-batch-size", "--seq-length", "--tp", "--pp", "--vpp",
                 "--lr", "--data", "--output-dir", "--save-interval", "--load", "--seed", "--wandb",
                 "--epas-interval", "--epas-growth", "--epas-target-layers", "--epas-share", "--epas-rebalance"):
        assert flag in flags and flags[flag], flag


def test_precedence(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model:\n  preset: small\n  hidden_size: 512\ntraining:\n  lr: 0.01\n  train_iters: 7\n")
    cfg = parse_config(["--config", str(yaml_file), "--lr", "0.02"])
    assert cfg.model.hidden_size == 512          # YAML over preset
    assert cfg.model.num_layers == PRESETS["small"].num_layers  # preset over default
    assert cfg.training.lr == 0.02               # flag over YAML
    assert cfg.training.train_iters == 7
    assert cfg.training.micro_batch_size == 8    # preset's training default


def test_flat_yaml_keys_and_round_trip(tmp_path):
    yaml_file = tmp_path / "flat.yaml"
    yaml_file.write_text("tp: 2\nepas_target_layers: '0.5'\ndata: [a, b]\n")
    cfg = parse_config(["--config", str(yaml_file)])
    assert cfg.parallel.tp == 2 and cfg.epas.epas_target_layers == "0.5" and cfg.data.data == ["a", "b"]
    assert from_dict(to_dict(cfg)) == cfg
    assert "epas_target_layers: '0.5'" in dump_yaml(cfg)


def test_bad_yaml_values_name_the_flag(tmp_path):
    yaml_file = tmp_path / "bad.yaml"
    yaml_file.write_text("training:\n  train_iters: many\n")
    with pytest.raises(ConfigError, match="--train-iters expects int"):
        parse_config(["--config", str(yaml_file)])
    yaml_file.write_text("bogus_key: 1\n")
    with pytest.raises(ConfigError, match="bogus_key"):
        parse_config(["--config", str(yaml_file)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])


def test_boolean_flags():
    assert parse_config(["--wandb"]).logging.wandb is True
    assert parse_config(["--no-tensorboard"]).logging.tensorboard is False


def test_default_ffn_size_is_llama_swiglu():
    assert default_ffn_hidden_size(4096) == 11008
    assert default_ffn_hidden_size(768) == 2048
    assert default_ffn_hidden_size(2048) == 5632  # TinyLLaMA


def test_epas_exclude_last_resolves_into_the_schedule(tmp_path):
    from epas_megatron.validation import resolve_run

    base = ["--preset", "tiny", "--output-dir", str(tmp_path / "out")]
    run = resolve_run(parse_config([*base, "--epas-target-layers", "2", "--epas-interval", "10", "--epas-exclude-last", "1"]), world_size=1)
    assert run.schedule.exclude_last == 1 and run.schedule.sharing_layers(20) == (1, 2)
    assert run.warnings == ()
    off = resolve_run(parse_config([*base, "--epas-exclude-last", "1"]), world_size=1)
    assert off.warnings == ("--epas-exclude-last 1 has no effect: EPAS is off (--epas-target-layers 0)",)
    assert parse_config(["--preset", "tiny"]).epas.epas_exclude_last == 0


def test_random_ltd_resolves_into_its_schedule(tmp_path):
    from epas_megatron.training.random_ltd import RandomLTDFeature
    from epas_megatron.training.registry import features_for_run
    from epas_megatron.validation import resolve_run

    base = ["--preset", "tiny", "--output-dir", str(tmp_path / "out"), "--train-iters", "100"]
    run = resolve_run(parse_config([*base, "--random-ltd", "--random-ltd-layers", "1,2", "--random-ltd-min-value", "8"]), world_size=1)
    ltd = RandomLTDFeature.schedule_of(run.cfg)
    assert (ltd.layers, ltd.min_value, ltd.max_value, ltd.require_steps, ltd.seq_per_step) == ((1, 2), 8, 64, 70, 4)
    assert run.warnings == ()
    off = resolve_run(parse_config([*base, "--random-ltd-min-value", "8"]), world_size=1)
    # The feature checks its own flags (the resolver does not); the trainer prints its warnings.
    assert RandomLTDFeature.schedule_of(off.cfg) is None and off.warnings == ()
    assert features_for_run(off).warnings == ("--random-ltd-min-value has no effect without --random-ltd",)
    # YAML section of its own, like the flags
    assert "random_ltd" in to_dict(parse_config([*base, "--random-ltd"]))


def test_no_save_final_negates_save_final_and_old_configs_read_the_same():
    """``--no-save-final`` turns the final checkpoint off (it once named a field of its own, which
    argparse's negation turned back off); older configs' ``no_save_final`` map onto ``save_final``."""
    from epas_megatron.config.cli import from_dict, parse_config, to_dict

    assert parse_config([]).checkpoint.save_final is True
    assert parse_config(["--no-save-final"]).checkpoint.save_final is False
    assert parse_config(["--save-final"]).checkpoint.save_final is True
    old = to_dict(parse_config([]))
    del old["checkpoint"]["save_final"]
    old["checkpoint"]["no_save_final"] = True
    assert from_dict(old).checkpoint.save_final is False


def test_the_trainer_reports_what_the_features_say_about_their_flags(tmp_path):
    from epas_megatron.training.trainer import Trainer
    from epas_megatron.validation import resolve_run

    run = resolve_run(parse_config(["--preset", "tiny", "--output-dir", str(tmp_path / "out"), "--epas-target-layers", "0",
                                    "--epas-switch-rewarm", "2"]), world_size=1)
    assert run.warnings == ()
    trainer = Trainer(run)
    try:
        assert trainer.run.warnings == ("--epas-switch-rewarm 2 has no effect: EPAS is off (--epas-target-layers 0)",)
    finally:
        trainer.close()
    assert not (tmp_path / "out").exists()
