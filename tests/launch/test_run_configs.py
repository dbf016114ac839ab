"""launch/configs/*.yaml: every run config parses, fits the worlds it is written for, and has
EPAS on with the full region reached around the middle of training."""

from __future__ import annotations

from pathlib import Path

import pytest

from epas_megatron.config.cli import parse_config
from epas_megatron.validation import resolve_run

CONFIG_DIR = Path(__file__).resolve().parents[2] / "launch" / "configs"
CPU_CONFIGS = {"tiny": (1, 2), "small": (1, 2)}
GPU_CONFIGS = {"125m": (8, 16, 32), "350m": (8, 16, 32), "1b": (8, 16, 32), "3b": (8, 16, 32), "7b": (8, 16, 32)}
EXPECTED_PARALLEL = {"125m": (1, 1), "350m": (1, 1), "1b": (1, 1), "3b": (2, 1), "7b": (2, 2)}


def test_every_preset_has_a_config():
    from epas_megatron.config.presets import PRESETS

    assert set(PRESETS) <= {p.stem for p in CONFIG_DIR.glob("*.yaml")}


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_config_parses_to_the_values_it_writes(path):
    """Every value the YAML file sets (read here with PyYAML, section by section) is the value
    of that field of the parsed config (``epas_*`` keys name the ``epas`` section's fields)."""
    import yaml

    cfg = parse_config(["--config", str(path)])
    written = yaml.safe_load(path.read_text())
    assert written and set(written) <= {"model", "parallel", "training", "checkpoint", "logging", "epas", "data", "random_ltd"}
    for section, values in written.items():
        fields = getattr(cfg, section)
        for key, value in values.items():
            name = key if hasattr(fields, key) else key.removeprefix("epas_")
            assert hasattr(fields, name), f"{path.name}: {section}.{key} is not a config field"
            assert getattr(fields, name) == value, f"{path.name}: {section}.{key}"


@pytest.mark.parametrize("name", sorted({**CPU_CONFIGS, **GPU_CONFIGS}))
def test_preset_config_fits_its_worlds(name, tmp_path):
    path = CONFIG_DIR / f"{name}.yaml"
    cfg = parse_config(["--config", str(path)])
    assert cfg.model.preset == name
    gpu = name in GPU_CONFIGS
    # A GPU config names no data (its comment says how); the embedded demo corpus needs its name.
    cfg = parse_config(["--config", str(path), "--output-dir", str(tmp_path / "run"), *(["--data", "embedded"] if gpu else [])])
    if gpu:
        assert (cfg.parallel.tp, cfg.parallel.pp) == EXPECTED_PARALLEL[name]
        assert cfg.training.precision == "auto" and cfg.training.seq_length == 2048
    for world in (GPU_CONFIGS if gpu else CPU_CONFIGS)[name]:
        run = resolve_run(cfg, world_size=world, cuda=gpu)
        assert run.bf16 == gpu
        assert run.schedule.enabled and not run.warnings
        # Sensible schedule: half the layers share at the end, reached near mid-training.
        assert run.schedule.target_layers == cfg.model.num_layers // 2
        assert 0.4 <= run.schedule.final_iteration / cfg.training.train_iters <= 0.55
