"""Every bad input: exit status 2, a message naming the flag, before any process group or data
work, and nothing written."""

import os

import pytest
import torch
import torch.distributed as dist

from epas_megatron.train import main
from epas_testing import TINY, run_trainer


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """An empty data cache and output location; WORLD_SIZE as torchrun would set it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("EPAS_CACHE_DIR", str(cache))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return tmp_path


def fails(argv, isolated, capsys, flag, world_size=None, monkeypatch=None, match=None):
    if world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    out = isolated / "out"
    code = main([*TINY, "--output-dir", str(out), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines and flag in lines[0], err
    if match:
        assert match in err, err
    assert not dist.is_initialized()
    assert not out.exists(), "nothing may be written"
    assert not (isolated / "cache").exists(), "no data work may start"
    return err


def test_heads_not_divisible_by_tp(isolated, capsys, monkeypatch):
    fails(["--tp", "3"], isolated, capsys, "--tp", 3, monkeypatch, match="--num-attention-heads 4")


def test_query_groups_not_divisible_by_tp(isolated, capsys, monkeypatch):
    fails(["--num-query-groups", "1", "--tp", "2"], isolated, capsys, "--num-query-groups", 2, monkeypatch)


def test_world_size_not_divisible_by_tp_times_pp(isolated, capsys, monkeypatch):
    fails(["--tp", "2", "--pp", "2"], isolated, capsys, "--tp", 2, monkeypatch, match="does not divide the 2 processes")


def test_layers_not_splittable_over_pp(isolated, capsys, monkeypatch):
    fails(["--pp", "3"], isolated, capsys, "--pp", 3, monkeypatch, match="--num-layers 4")


def test_layers_not_splittable_over_vpp(isolated, capsys, monkeypatch):
    fails(["--pp", "2", "--vpp", "3"], isolated, capsys, "--vpp", 2, monkeypatch)


def test_bad_pipeline_layout(isolated, capsys, monkeypatch):
    fails(["--pp", "2", "--pipeline-layout", "Et|ttL"], isolated, capsys, "--pipeline-layout", 2, monkeypatch)


def test_global_batch_not_divisible(isolated, capsys, monkeypatch):
    fails(["--global-batch-size", "6", "--micro-batch-size", "2"], isolated, capsys, "--global-batch-size", 2, monkeypatch,
          match="data-parallel size 2")


def test_sequence_longer_than_the_model(isolated, capsys):
    fails(["--seq-length", "128", "--max-position-embeddings", "64"], isolated, capsys, "--seq-length")


def test_missing_data(isolated, capsys):
    fails(["--data", str(isolated / "nope" / "corpus"), "--tokenizer-model", "x"], isolated, capsys, "--data", match="does not exist")


def test_empty_data(isolated, capsys):
    (isolated / "d").mkdir()
    for ext in (".bin", ".idx"):
        (isolated / "d" / f"corpus{ext}").write_bytes(b"")
    fails(["--data", str(isolated / "d" / "corpus")], isolated, capsys, "--data", match="empty")


def test_unreadable_tokenizer(isolated, capsys):
    bad = isolated / "tokenizer.model"
    bad.write_bytes(os.urandom(256))
    fails(["--tokenizer-model", str(bad)], isolated, capsys, "--tokenizer-model")


def test_unknown_preset(isolated, capsys):
    fails(["--preset", "huge"], isolated, capsys, "--preset")


def test_unknown_flag(isolated, capsys):
    fails(["--tensor-parallel-degree", "2"], isolated, capsys, "--tensor-parallel-degree")


def test_bad_epas_schedule(isolated, capsys):
    fails(["--epas-target-layers", "3", "--epas-growth", "2"], isolated, capsys, "--epas-growth")
    fails(["--epas-target-layers", "4"], isolated, capsys, "--epas-target-layers")
    fails(["--epas-target-layers", "2", "--epas-interval", "60", "--train-iters", "100"], isolated, capsys, "--train-iters")
    fails(["--epas-target-layers", "3", "--epas-exclude-last", "1"], isolated, capsys, "--epas-target-layers",
          match="--epas-exclude-last 1 (the region ends at layer 2); use at most 2")
    fails(["--epas-exclude-last", "-1"], isolated, capsys, "--epas-exclude-last")


def test_bad_switch_rewarm(isolated, capsys):
    fails(["--epas-target-layers", "2", "--epas-interval", "4", "--epas-switch-rewarm", "4"], isolated, capsys, "--epas-switch-rewarm",
          match="must be smaller than --epas-interval 4: the re-warm after a switch must end before the next switch; use at most 3")
    fails(["--epas-target-layers", "2", "--epas-interval", "4", "--epas-switch-rewarm", "-1"], isolated, capsys, "--epas-switch-rewarm",
          match=">= 0")


def test_bad_switch_ramp(isolated, capsys, monkeypatch):
    epas = ["--epas-target-layers", "2", "--epas-interval", "4"]
    fails([*epas, "--epas-switch-ramp", "4"], isolated, capsys, "--epas-switch-ramp",
          match="must be smaller than --epas-interval 4: a ramp must not contain the previous switch; use at most 3")
    fails([*epas, "--epas-first-switch", "2", "--epas-switch-ramp", "2"], isolated, capsys, "--epas-switch-ramp",
          match="needs the first switch after iteration 2")
    fails([*epas, "--epas-switch-ramp", "2", "--random-ltd"], isolated, capsys, "--epas-switch-ramp", match="--random-ltd")
    fails([*epas, "--epas-switch-ramp", "2", "--pp", "2"], isolated, capsys, "--epas-switch-ramp", world_size=2,
          monkeypatch=monkeypatch, match="needs --pp 1")


def test_output_dir_holding_another_run(isolated, capsys):
    out = isolated / "out"
    out.mkdir()
    (out / "config.yaml").write_text("model: {num_layers: 12}\n")
    code = main([*TINY, "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--output-dir" in err and "--load" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    assert not (isolated / "cache").exists()


def test_resuming_a_checkpoint_of_another_model_shape(tmp_path, capsys, monkeypatch):
    run = run_trainer([*TINY, "--train-iters", "2"], tmp_path / "first")
    monkeypatch.setenv("EPAS_CACHE_DIR", str(tmp_path / "cache2"))
    out = tmp_path / "second"
    code = main([*TINY, "--hidden-size", "96", "--load", str(run.output_dir / "checkpoints"), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--load" in err and "--hidden-size: checkpoint 64, this run 96" in err, err
    assert not out.exists() and not dist.is_initialized()


def test_help_is_readable(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for expected in ("--epas-target-layers", "--tp", "--global-batch-size", "Deepest layers that will share",
                     "--epas-exclude-last", "Deepest layers that never share", "parallel:", "epas:"):
        assert expected in text, expected


def test_resuming_with_another_vocabulary_fails_before_data_work(isolated, capsys):
    """The vocabulary is resolved with the config, so a checkpoint trained with another
    tokenizer is refused before the embedded corpus or its tokenizer is built."""
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_406e8ca"  # vocabulary 512
    fails(["--default-vocab-size", "1024", "--load", str(fixture)], isolated, capsys, "--load",
          match="the checkpoint's vocabulary is 512, this run's is 1024")


@pytest.mark.parametrize("argv, flag", [
    (["--random-ltd", "--random-ltd-layers", "2-7"], "--random-ltd-layers"),
    (["--random-ltd", "--random-ltd-min-value", "100"], "--random-ltd-min-value"),
    (["--random-ltd", "--random-ltd-kernels", "cuda"], "--random-ltd-kernels"),
    (["--random-ltd", "--tp", "2", "--sequence-parallel"], "--sequence-parallel"),
    pytest.param(["--random-ltd", "--random-ltd-kernels", "deepspeed"], "--random-ltd-kernels",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels may load on a GPU node")),
])
def test_random_ltd_flags(isolated, capsys, monkeypatch, argv, flag):
    fails(argv, isolated, capsys, flag, 2 if "--tp" in argv else None, monkeypatch)


@pytest.mark.parametrize("model", [["--preset", "125m"], ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                                                            "--num-query-groups", "12", "--ffn-hidden-size", "2048"]],
                         ids=["preset", "flags"])
def test_a_model_larger_than_small_needs_its_data_named(model, isolated, capsys):
    """No --data means the embedded demo corpus (about 0.44M tokens): a model larger than the
    'small' preset (by decoder parameters) stops, naming --data and --data embedded."""
    err = fails([*model, "--train-iters", "1"], isolated, capsys, "has no --data", match="--data embedded")
    assert "12 layers, hidden 768: 85M decoder parameters" in err  # 12 x (768 x (768 + 2 x 768) + 768^2 + 3 x 768 x 2048 + 2 x 768)


def test_a_tokenizer_without_data_is_refused(isolated, capsys):
    """The embedded corpus is tokenized with its own tokenizer: another one would read its token
    ids as other pieces."""
    fails(["--tokenizer-model", str(isolated / "any.model")], isolated, capsys, "--tokenizer-model", match="without --data")


def test_named_embedded_data_trains_a_larger_model(tmp_path, monkeypatch):
    """--data embedded: the same corpus, asked for by name; checked before any work (the
    resolved run keeps the name, which the data sources read as the embedded corpus)."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.config.presets import too_large_for_the_embedded_corpus
    from epas_megatron.validation import resolve_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = resolve_run(parse_config(["--preset", "125m", "--data", "embedded", "--output-dir", str(tmp_path / "out")]), world_size=1)
    assert run.cfg.data.data == ["embedded"] and run.cfg.data.embedded
    assert too_large_for_the_embedded_corpus(12, 768, 12, 12, 2048)
    assert not too_large_for_the_embedded_corpus(8, 384, 6, 2, 1024)  # 'small' itself
    # epas-plan plans a model without training it: no data needed
    assert resolve_run(parse_config(["--preset", "125m", "--output-dir", str(tmp_path / "p")]), world_size=1, planning_only=True)


def test_recompute_modules_need_selective_recompute_and_known_modules(isolated, capsys):
    fails(["--recompute-modules", "mlp"], isolated, capsys, "--recompute-modules", match="needs --recompute selective")
    fails(["--recompute", "selective", "--recompute-modules", "layernorm"], isolated, capsys, "--recompute-modules",
          match="choose among core_attn, mlp")


@pytest.mark.parametrize("argv, match", [
    (["--pipeline-schedule", "v-1f1b"], "needs --pp >= 2"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--vpp", "2"], "drop --vpp 2"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--no-untie-embeddings-and-output-weights"], "--no-untie-embeddings"),
    # A V layout (--pipeline-layout V:..., stages in V order) is parsed and checked (tiny: 4 layers)
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "V:Et|t|ttL"], "has 3 stages; V placement over --pp 2"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "V:Ett||t|tL"], "V stage 1 holds no decoder layer"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "V:Ett|t|t|tL"], "holds 5 decoder layers, but --num-layers is 4"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "V:t|Et|t|tL"], "expected 'E' opening the first stage"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "V:Ex|t|t|tL"], "Invalid layer character: x"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "Et|t|t|tL"], "takes a V layout, 'V:' and its 2 x --pp"),
    (["--pp", "2", "--pipeline-layout", "V:Et|t|t|tL"], "only a V schedule runs"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--pipeline-layout", "V:Et|t|t|tL", "--epas-rebalance", "on"],
     "--epas-rebalance on conflicts with a fixed --pipeline-layout"),
    (["--pp", "2", "--pipeline-schedule", "v-half", "--epas-memory-budget-gb", "10"], "does not price memory yet"),
    (["--pp", "2", "--pipeline-schedule", "v-1f1b", "--global-batch-size", "2", "--micro-batch-size", "2"],
     "needs at least 2 micro-batches per iteration, got 1"),
    (["--pp", "2", "--pipeline-schedule", "interleaved"], "needs --vpp >= 2"),
    (["--pp", "2", "--vpp", "2", "--pipeline-schedule", "1f1b"], "drop --vpp 2"),
    (["--pp", "2", "--pipeline-schedule", "zb-v"], "choose one of 1f1b, interleaved, v-1f1b, v-half, v-min"),
])
def test_pipeline_schedule_refusals(argv, match, isolated, capsys, monkeypatch):
    fails(["--global-batch-size", "8", "--micro-batch-size", "2", *argv], isolated, capsys, "--", world_size=2,
          monkeypatch=monkeypatch, match=match)


def test_v_schedules_rebalance_and_take_a_v_layout(tmp_path, monkeypatch):
    """Stage rebalancing under V placement: --epas-rebalance on and auto (the auto rule: --pp > 1
    and no fixed --pipeline-layout) rebalance, off does not; a V layout is a fixed layout, its
    stages (in V order) the run's, which auto then leaves alone."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.validation import resolve_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def resolved(*argv):
        return resolve_run(parse_config([*TINY, "--pp", "2", "--pipeline-schedule", "v-1f1b", "--global-batch-size", "8",
                                         "--output-dir", str(tmp_path / "out"), *argv]), world_size=2)

    assert [resolved("--epas-rebalance", flag).rebalance for flag in ("on", "auto", "off")] == [True, True, False]
    assert resolved().v_layout is None  # the even V split
    # Six layers: stage 0 (rank 0) 2, stage 1 (rank 1) 1, stage 2 (rank 1) 1, stage 3 (rank 0) 2.
    fixed = resolved("--num-layers", "6", "--pipeline-layout", "V:Ett|t|t|ttL")
    assert fixed.v_layout.stage_sizes == (2, 1, 1, 2) and not fixed.rebalance and fixed.layout is None
    assert resolved("--num-layers", "6", "--pipeline-layout", "V:Et*2|t|t|t*2L").v_layout == fixed.v_layout  # Megatron's t*n


@pytest.mark.parametrize("name", ["v-half", "v-min"])
def test_split_backward_schedules_need_the_local_layers(name, tmp_path):
    """The weight-gradient split is built for the local linears; with Transformer Engine's layers
    (chosen on a GPU node) the split schedules are refused, naming both ways out; local runs pass."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.errors import ConfigError
    from epas_megatron.validation import _resolve_pipeline_schedule

    cfg = parse_config(["--preset", "tiny", "--pp", "2", "--pipeline-schedule", name, "--output-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="--transformer-impl local or --pipeline-schedule v-1f1b"):
        _resolve_pipeline_schedule(cfg, cfg.model, None, 4, "transformer_engine")
    assert _resolve_pipeline_schedule(cfg, cfg.model, None, 4, "local").name == name
    v_1f1b = parse_config(["--preset", "tiny", "--pp", "2", "--pipeline-schedule", "v-1f1b", "--output-dir", str(tmp_path)])
    assert _resolve_pipeline_schedule(v_1f1b, v_1f1b.model, None, 4, "transformer_engine").name == "v-1f1b"


def test_epas_plan_makes_the_features_refusals_too(capsys):
    """A training feature checks its own flags (TrainingFeature.check_config); epas-plan, which
    builds no trainer, asks the features as epas-train does."""
    from epas_megatron.plan import main as plan_main

    code = plan_main(["--world-size", "2", *TINY, "--epas-target-layers", "2", "--epas-interval", "4",
                      "--epas-switch-ramp", "2", "--pp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "error: --epas-switch-ramp 2 needs --pp 1" in err, err
