"""Switches with stage rebalancing on PP=2 follow the PP=1 run at every iteration, the layout in
metrics.jsonl changes at the switches as planned, and a run resumes after a re-layout with the
same or a different PP size."""

import pytest

from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.parallel.stage_layouts import flops_layer_costs, region_layout
from epas_testing import assert_close, run_trainer

pytestmark = pytest.mark.distributed

# A shape where attention projections dominate (ffn 64), so sharing moves the balance: the
# planner puts 5|3 layers at region 0 (LM head on the last stage), 4|4 at regions 1-3, then keeps
# the region with its source on the last stage, 3|5, 2|6 and 1|7 at regions 4-6 (at this size the
# hand-off's extra p2p rows would cost about 7 layers), and 5|3 at 7, where it must cross.
SHAPE = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "4",
         "--ffn-hidden-size", "64", "--default-vocab-size", "1024", "--seq-length", "64"]
ARGS = ["--eval-interval", "0", "--no-tensorboard", "--log-interval", "1", *SHAPE, "--train-iters", "9",
        "--global-batch-size", "4", "--micro-batch-size", "1", "--epas-target-layers", "7", "--epas-interval", "1",
        "--seed", "11", "--init-method-std", "0.1", "--save-interval", "3", "--keep-last", "0"]


def planned_layouts(max_region=7):
    """The planner's layout per region (as the trainer asks it at every switch)."""
    costs = flops_layer_costs(LlamaArchitecture(8, 128, 4, 4, 64, 1024, 64), 64)
    return {region: region_layout(costs, 8, 2, None, tuple(range(8 - region, 8))).to_layout_string()
            for region in range(max_region + 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("rebalance")
    # Both validate at every third iteration at regions 0, half the region in training and 7 (as
    # inference-time sharing until reached), on whatever layout is in place then.
    regions = ["--eval-interval", "3", "--eval-iters", "1", "--eval-regions", "0,half,7", "--eval-untrained-regions"]
    single = run_trainer([*ARGS, *regions], base / "pp1")
    pp2 = run_trainer([*ARGS, *regions, "--pp", "2", "--epas-rebalance", "on"], base / "pp2", nproc=2)
    return single, pp2


def test_rebalanced_pp2_matches_pp1_every_iteration(runs):
    single, pp2 = runs
    assert_close(pp2.losses, single.losses, 1e-5, "loss")
    assert_close(pp2.grad_norms, single.grad_norms, 1e-5, "grad norm")


def test_regions_evaluated_on_rebalanced_layouts_match_pp1(runs):
    single, pp2 = runs
    valid = lambda run: {(m["iteration"], m["region"]): m["lm_loss"] for m in run.metrics if m.get("kind") == "valid"}
    assert sorted(valid(single)) == [(3, 0), (3, 1), (3, 3), (3, 7), (6, 0), (6, 3), (6, 6), (6, 7), (9, 0), (9, 3), (9, 7)]
    assert_close(valid(pp2), valid(single), 1e-5, "validation per region")


def test_switch_modes_are_bit_identical_through_relayouts(runs, tmp_path):
    """Seven switches, most of them moving layers between the stages: the in-memory switch (the
    default) sends the moved layers' tensors point to point and equals the checkpoint round trip
    bit for bit; it writes nothing, and moves bytes between ranks exactly at the re-layouts."""
    _, memory = runs
    checkpoint = run_trainer([*ARGS, "--pp", "2", "--epas-rebalance", "on", "--epas-switch-mode", "checkpoint"],
                             tmp_path / "checkpoint", nproc=2)
    assert (memory.losses, memory.grad_norms) == (checkpoint.losses, checkpoint.grad_norms)
    assert [s["layout"] for s in memory.switches] == [s["layout"] for s in checkpoint.switches]
    for switch in memory.switches:
        assert switch["switch_mode"] == "memory" and switch["switch_bytes_written"] == 0
        assert (switch["switch_bytes_between_ranks"] > 0) == (switch["layout"] != switch["previous_layout"]), switch
    assert all(s["switch_bytes_written"] > 0 for s in checkpoint.switches)


def test_distributed_optimizer_shards_follow_relayouts_bit_identically(tmp_path):
    """The same seven switches with the distributed optimizer: the in-memory switch moves its
    fp32 shards by element range (a switching layer's V rows assembled from its fused QKV on
    one rank) and equals the checkpoint round trip bit for bit."""
    args = [*ARGS, "--pp", "2", "--epas-rebalance", "on", "--use-distributed-optimizer", "--exit-interval", "7"]
    memory = run_trainer(args, tmp_path / "memory", nproc=2)
    checkpoint = run_trainer([*args, "--epas-switch-mode", "checkpoint"], tmp_path / "checkpoint", nproc=2)
    assert len(memory.switches) == 7 and any(s["switch_bytes_between_ranks"] > 0 for s in memory.switches)
    assert (memory.losses, memory.grad_norms) == (checkpoint.losses, checkpoint.grad_norms)


def test_layout_changes_at_switches_as_planned(runs):
    _, pp2 = runs
    planned = planned_layouts()
    layouts = {r["iteration"]: r["layout"] for r in pp2.train_records}
    assert layouts == {it: planned[min(it, 7)] for it in range(1, 10)}
    assert len(set(layouts.values())) >= 2  # the plan does move layers
    switch_layouts = {s["iteration"]: s["layout"] for s in pp2.switches}
    assert switch_layouts == {it: planned[it] for it in range(1, 8)}
    assert "pipeline stages, rebalanced at every switch" in pp2.stdout


@pytest.mark.parametrize("nproc,extra", [(2, ["--pp", "2", "--epas-rebalance", "on"]), (1, [])], ids=["pp2", "pp1"])
def test_resume_after_a_relayout(runs, tmp_path, nproc, extra):
    single, pp2 = runs
    ckpt = pp2.output_dir / "checkpoints" / "iter_0000003"  # taken after the re-layout at 1
    run = run_trainer([*ARGS, *extra, "--load", str(ckpt)], tmp_path / "resumed", nproc=nproc)
    expected = {k: v for k, v in single.losses.items() if k > 3}
    assert_close(run.losses, expected, 1e-5, "resumed loss")


def test_measured_cost_model_rebalances_and_matches_pp1(runs, tmp_path):
    """--epas-cost-model measured: layer forward times from the running model drive the plan;
    the layout is whatever they say, the losses still equal PP=1."""
    single, _ = runs
    run = run_trainer([*ARGS, "--pp", "2", "--epas-rebalance", "on", "--epas-cost-model", "measured",
                       "--epas-cost-timing-iters", "1", "--exit-interval", "6"],
                      tmp_path / "measured", nproc=2)
    expected = {k: v for k, v in single.losses.items() if k <= 6}
    assert_close(run.losses, expected, 1e-5, "measured-cost loss")
    assert all(record["layout"].startswith("E") and record["layout"].endswith("L") for record in run.train_records)


def test_a_memory_budget_changes_the_layout_not_the_losses(runs, tmp_path):
    """--epas-memory-budget-gb just under what the FLOP-optimal region-0 layout needs on rank 0
    (it holds 5 layers and 2 of the 4 micro-batches in flight): the run plans another layout
    there and says so, and its losses still equal PP=1's."""
    from epas_megatron.metrics.rank_memory import RankMemorySettings
    from epas_megatron.model.architecture import ModelShape
    from epas_megatron.parallel.memory_budget import GIB, MemoryLimit
    from epas_megatron.sharing.shape import layer_modes

    arch = LlamaArchitecture(8, 128, 4, 4, 64, 1024, 64)
    costs = flops_layer_costs(arch, 64)
    limit = MemoryLimit(ModelShape(arch, 64), RankMemorySettings(num_microbatches=4), 2, 1, 1e18)
    optimal = region_layout(costs, 8, 2, None, ())
    need = limit.layout_bytes(optimal, layer_modes(8, ()))[0]["total"]
    single, _ = runs
    run = run_trainer([*ARGS, "--pp", "2", "--epas-rebalance", "on", "--epas-memory-budget-gb", repr((need - 1) / GIB),
                       "--exit-interval", "3"], tmp_path / "budget", nproc=2)
    assert f"memory budget at iteration 0: the FLOP-optimal layout {optimal.to_layout_string()} would need" in run.stdout
    assert_close(run.losses, {k: v for k, v in single.losses.items() if k <= 3}, 1e-5, "loss under a memory budget")
