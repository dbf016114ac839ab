"""CheckpointMeta: every version of run_meta.json reads into one typed object with the documented
defaults, and a record written by this version reads back to the same JSON."""

import json
from pathlib import Path

import pytest

from epas_megatron.checkpointing.metadata import MODEL_FIELDS, CheckpointMeta, SavedParallel, model_record
from epas_megatron.config.cli import parse_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_406e8ca" / "iter_0000007" / "run_meta.json"


def test_the_406e8ca_checkpoint_reads_with_its_values_and_the_old_defaults():
    raw = json.loads(FIXTURE.read_text())
    meta = CheckpointMeta.from_dict(raw)
    # Values as written in 2026 by commit 406e8ca (read off the file).
    assert meta.iteration == 7 and meta.consumed_samples == 28 and meta.sharing_layers == (2, 3)
    assert meta.num_layers == 4 and meta.trained_region == 2 and meta.epas_share == "qk" and meta.backend == "local"
    assert meta.parallel == SavedParallel(tp=1, pp=1, dp=1, vpp=None, layout=None, use_distributed_optimizer=None)
    # That version wrote no exclude_last anywhere: its regions ended at the last layer.
    assert "exclude_last" not in raw["epas_schedule"] and meta.exclude_last == 0
    assert meta.run_config().model.num_layers == 4
    assert meta.has_optimizer_state is True and meta.features == {} and meta.extra == {}


def test_defaults_of_a_hugging_face_import_and_unknown_keys_kept():
    record = {"model": {"num_layers": 2}, "iteration": 0, "config": {}, "sharing_layers": [], "tokenizer_model": None,
              "imported_from": "/hf/dir", "has_optimizer_state": False}
    meta = CheckpointMeta.from_dict(record)
    assert (meta.parallel, meta.precision, meta.backend, meta.epas_schedule) == (None, None, None, None)
    assert meta.epas_share == "qk" and meta.exclude_last == 0 and meta.has_optimizer_state is False
    assert meta.extra == {"imported_from": "/hf/dir"}
    written = meta.to_dict()
    assert written["imported_from"] == "/hf/dir" and "parallel" not in written and "epas_schedule" not in written


@pytest.mark.parametrize("schedule, config, expected", [
    ({"exclude_last": 2}, {"epas": {"epas_exclude_last": 1}}, 2),  # the saved schedule decides
    ({}, {"epas": {"epas_exclude_last": 1}}, 1),                   # else the saved config
    (None, None, 0),                                               # else 0 (older checkpoints, imports)
])
def test_exclude_last_sources(schedule, config, expected):
    assert CheckpointMeta.from_dict({"model": {}, "epas_schedule": schedule, "config": config}).exclude_last == expected


def test_a_full_record_reads_back_to_the_same_json():
    raw = json.loads(FIXTURE.read_text())
    raw["parallel"]["use_distributed_optimizer"] = True
    raw["features"] = {"random_ltd": {"layers": [1, 2]}, "epas_switch_ramp": {"steps": 3}}
    raw["precision"] = "bf16"
    assert CheckpointMeta.from_dict(raw).to_dict() == raw


def test_older_top_level_feature_records_are_read_into_features_once():
    """Checkpoints before features kept their own records wrote them at the top level: they are
    read into ``features`` (and written back there); a feature absent was off."""
    raw = json.loads(FIXTURE.read_text())
    raw["random_ltd"], raw["epas_switch_rewarm"] = {"layers": [1, 2]}, {"steps": 4}
    meta = CheckpointMeta.from_dict(raw)
    assert meta.features == {"random_ltd": {"layers": [1, 2]}, "epas_switch_rewarm": {"steps": 4}} and meta.extra == {}
    written = meta.to_dict()
    assert "random_ltd" not in written and written["features"] == meta.features


def test_model_record_is_the_model_fields_of_a_config():
    cfg = parse_config(["--preset", "tiny", "--vocab-size", "300"])
    record = model_record(cfg.model)
    assert list(record) == list(MODEL_FIELDS)
    assert record == {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
                      "ffn_hidden_size": 176, "vocab_size": 300, "untie_embeddings_and_output_weights": True,
                      "moc_topk": 1.0, "moc_groups": 8}
