"""The assembly: each source (a resolved run, a checkpoint's metadata, a preset) gives the plan
its flags, file or preset say, checked field by field against values written out by hand."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from epas_megatron.assembly import (
    checkpoint_meta_for_import,
    checkpoint_meta_for_run,
    checkpoint_regions,
    optimizer_settings_for_run,
    plan_for_checkpoint,
    plan_for_preset,
    plan_for_run,
)
from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.config.cli import parse_config
from epas_megatron.errors import ConfigError
from epas_megatron.model.build_plan import RecomputeSettings
from epas_megatron.random_ltd.option import RandomLTDSettings
from epas_megatron.sharing.shape import LayerMode
from epas_megatron.validation import resolve_run

FIXTURE_META = Path(__file__).resolve().parent / "fixtures" / "checkpoint_406e8ca" / "iter_0000007" / "run_meta.json"


def _run(tmp_path, *flags, world_size=2):
    cfg = parse_config(["--preset", "tiny", "--output-dir", str(tmp_path / "run"), *flags])
    return resolve_run(cfg, world_size=world_size, cuda=False)


def test_plan_for_a_run_carries_every_flag(tmp_path):
    run = _run(tmp_path, "--pp", "2", "--recompute", "selective", "--epas-share", "kv", "--epas-detach-shared",
               "--epas-exclude-last", "1", "--epas-target-layers", "2", "--epas-interval", "2", "--train-iters", "10",
               "--core-attention", "unfused", "--deterministic",
               "--random-ltd", "--random-ltd-layers", "1,2", "--seed", "7", "--seq-length", "32")
    plan = plan_for_run(run, (1, 2))
    arch = plan.arch
    # tiny: 4 layers, hidden 64, 4 heads / 2 groups, FFN 176, the embedded tokenizer's 512 pieces
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size,
            arch.vocab_size) == (4, 64, 4, 2, 176, 512)
    assert plan.seq_length == 32 and (plan.tp, plan.pp, plan.vpp, plan.layout) == (1, 2, None, None)
    assert plan.modes == (LayerMode.SOURCE, LayerMode.SHARE, LayerMode.SHARE, LayerMode.COMPUTE)
    assert plan.precision == "fp32" and plan.backend == "local" and plan.core_attention == "unfused"
    assert plan.recompute == RecomputeSettings("selective") and plan.deterministic
    assert (plan.share, plan.detach_shared, plan.shape.exclude_last) == ("kv", True, 1)
    assert plan.options == (RandomLTDSettings((1, 2), seed=7, kernels="auto"),)


def test_optimizer_settings_for_a_run(tmp_path):
    run = _run(tmp_path, "--lr", "3e-4", "--min-lr", "3e-5", "--weight-decay", "0.05", "--lr-warmup-iters", "5",
               "--train-iters", "40", "--lr-decay-style", "linear", "--clip-grad", "0.5", "--precision", "fp16",
               "--use-distributed-optimizer")
    s = optimizer_settings_for_run(run)
    assert (s.lr, s.min_lr, s.weight_decay, s.clip_grad) == (3e-4, 3e-5, 0.05, 0.5)
    assert (s.warmup_iters, s.decay_iters, s.decay_style, s.lr_schedule_units) == (5, 40, "linear", None)
    assert s.precision == "fp16" and s.use_distributed_optimizer is True


def test_checkpoint_meta_of_a_run_writes_what_older_checkpoints_hold(tmp_path):
    run = _run(tmp_path, "--epas-target-layers", "2", "--epas-interval", "2", "--train-iters", "10", world_size=1)
    plan = plan_for_run(run, (2, 3))
    dims = SimpleNamespace(tp=1, pp=1, dp=1, vpp=None)
    meta = checkpoint_meta_for_run(run, dims=dims, plan=plan, consumed_samples=28, tokenizer_model="tok.model")
    written = meta.to_dict()
    old = json.loads(FIXTURE_META.read_text())  # written by the trainer of commit 406e8ca
    assert set(old) - {"iteration", "has_optimizer_state"} <= set(written)
    assert written["sharing_layers"] == [2, 3] and written["consumed_samples"] == 28 and written["precision"] == "fp32"
    assert written["parallel"] == {"tp": 1, "pp": 1, "dp": 1, "vpp": None, "layout": None, "use_distributed_optimizer": False}
    assert written["epas_schedule"]["target_layers"] == 2 and written["tokenizer_model"] == "tok.model"
    assert CheckpointMeta.from_dict(written) == meta


def test_plan_for_a_checkpoint_at_its_regions():
    meta = CheckpointMeta.from_dict(json.loads(FIXTURE_META.read_text()))  # 4 layers, trained region [2, 3]
    assert plan_for_checkpoint(meta, cuda=False).sharing_layers == (2, 3)
    assert plan_for_checkpoint(meta, 0, cuda=False).sharing_layers == ()
    plan = plan_for_checkpoint(meta, 3, tp=2, pp=2, cuda=False)
    assert plan.sharing_layers == (1, 2, 3) and (plan.tp, plan.pp) == (2, 2)
    assert plan.precision == "fp32" and plan.backend == "local" and plan.seq_length == 64  # the saved run's
    assert plan_for_checkpoint(meta, precision="auto", cuda=True).precision == "bf16"
    assert plan_for_checkpoint(meta, precision="fp16", cuda=False).precision == "fp16"
    # A checkpoint trained with --epas-exclude-last 1: its regions end at layer 2.
    excluded = CheckpointMeta.from_dict({**json.loads(FIXTURE_META.read_text()), "epas_schedule": {"exclude_last": 1},
                                         "sharing_layers": [2]})
    assert plan_for_checkpoint(excluded, cuda=False).sharing_layers == (2,)
    with pytest.raises(ConfigError, match="--region"):
        plan_for_checkpoint(excluded, 3, flag="--region", cuda=False)


def test_checkpoint_regions():
    meta = CheckpointMeta.from_dict(json.loads(FIXTURE_META.read_text()))
    assert checkpoint_regions(meta, "0,half,max") == [0, 1, 2]
    with pytest.raises(ConfigError, match="larger than the region this checkpoint was trained with"):
        checkpoint_regions(meta, "3")
    assert checkpoint_regions(meta, "3", allow_untrained=True) == [3]


def test_plan_for_a_preset():
    plan = plan_for_preset("tiny", (3,), seq_length=128, cuda=False, share="kv", tp=2)
    # tiny leaves the vocabulary to the tokenizer: benchmarks assume the default 8192 pieces
    assert plan.arch.vocab_size == 8192 and plan.arch.max_sequence_length == 128 and plan.seq_length == 128
    assert plan.sharing_layers == (3,) and plan.share == "kv" and plan.tp == 2 and plan.precision == "fp32"
    assert plan_for_preset("tiny", seq_length=16, cuda=True).arch.max_sequence_length == 64  # the preset's own, longer
    assert plan_for_preset("tiny", seq_length=16, cuda=True).precision == "bf16"


def test_meta_of_an_import():
    cfg = parse_config(["--preset", "tiny", "--vocab-size", "300"])
    record = checkpoint_meta_for_import(cfg, None, "/hf").to_dict()
    assert record["imported_from"] == "/hf" and record["sharing_layers"] == [] and record["model"]["vocab_size"] == 300
    assert "parallel" not in record and record["config"]["model"]["vocab_size"] == 300


def test_v_plans_of_a_run(tmp_path):
    """Under a V schedule the plan carries V stage sizes: the even V split, a --pipeline-layout
    V:... as given (then kept at a switch), or, rebalancing, the V balancer's split for the new
    region at every switch (its search is tested against brute force in tests/parallel)."""
    from epas_megatron.assembly import plan_after_switch
    from epas_megatron.parallel.balancer import balance_v_region
    from epas_megatron.parallel.stage_layouts import flops_layer_costs

    v = ("--pp", "2", "--pipeline-schedule", "v-1f1b", "--num-layers", "6", "--epas-target-layers", "2", "--epas-interval", "2",
         "--train-iters", "10", "--global-batch-size", "8")
    fixed = _run(tmp_path, *v, "--pipeline-layout", "V:Ett|t|t|ttL")
    plan = plan_for_run(fixed)
    assert not fixed.rebalance and plan.v_stage_sizes == (2, 1, 1, 2) and plan.layout_string == "V:Ett|t|t|ttL"
    after, _ = plan_after_switch(fixed, plan, (5,))
    assert after.v_stage_sizes == (2, 1, 1, 2) and after.sharing_layers == (5,)

    run = _run(tmp_path, *v, "--epas-rebalance", "on")
    plan = plan_for_run(run)
    assert plan.v_stage_sizes == (2, 2, 1, 1) and plan.layout is None and plan.vpp is None  # even until rebalanced
    costs = flops_layer_costs(plan.arch, plan.seq_length, plan.share)
    for sharing in [(), (5,), (4, 5)]:
        after, notice = plan_after_switch(run, plan, sharing)
        assert after.v_stage_sizes == balance_v_region(costs, 6, sharing, 2).stage_sizes and notice is None
        assert after.sharing_layers == sharing and after.layout_string.startswith("V:E")
    assert plan_after_switch(run, plan, (5,))[0].v_stage_sizes != plan.v_stage_sizes  # the layout does move
    # A memory budget (on CUDA, 90% of the GPU by default) is not priced under V: the notice says so.
    after, notice = plan_after_switch(run, plan, (5,), memory=object())
    assert after.v_stage_sizes == balance_v_region(costs, 6, (5,), 2).stage_sizes
    assert "not applied under --pipeline-schedule v-1f1b" in notice and "epas-plan" in notice
