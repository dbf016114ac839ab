"""Stage rebalancing under V placement (--pipeline-schedule v-1f1b --epas-rebalance on, two
ranks): the V stage sizes change at the switches as computed by hand below, the layers that
change rank move in memory, and every iteration's loss and gradient norm, and the validation
losses, equal the single-process run."""

import pytest

from epas_testing import assert_close, run_trainer

pytestmark = pytest.mark.distributed

# Attention projections dominate (ffn 64), so sharing moves the balance. In units of a computing
# layer (the FLOPs model at this shape): a sharing layer 2/3, the LM head and loss 4/3 (on rank 0,
# with V stages 0 and 3; rank 1 holds stages 1 and 2), the hand-off's extra p2p rows about 6.9
# per boundary side -- 2 per rank at p = 2 (the turn, stage 1 -> 2 on rank 1, is local).
SHAPE = ["--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "4",
         "--ffn-hidden-size", "64", "--default-vocab-size", "1024", "--seq-length", "64"]
ARGS = ["--no-tensorboard", "--log-interval", "1", *SHAPE, "--train-iters", "4", "--global-batch-size", "4",
        "--micro-batch-size", "1", "--epas-target-layers", "3", "--epas-interval", "1", "--epas-first-switch", "2",
        "--seed", "5", "--init-method-std", "0.1", "--no-save-final",
        "--eval-interval", "2", "--eval-iters", "1", "--eval-regions", "0"]

# The V layout per iteration (stages in V order), by hand:
# - region 0 (iteration 1): rank 0 pays 4/3 for the head, so it takes 2 layers (10/3) and rank 1
#   4 (bottleneck 4; 3 | 3 costs 13/3): stages 0 and 3 one layer each; of 1|1|3|1, 1|2|2|1 and
#   1|3|1|1 the last ends nearest the even 2|2|1|1 (ends 1,4,5 against 2,4,5).
# - region 1 (layer 5 shares, source 4; iteration 2): no stage may start at layer 5; 1|2|1|2
#   and 1|1|2|2 both give 4 | 3, the first nearer the even ends (3 against 4).
# - region 2 (layers 4-5, source 3; iteration 3): kept in one stage the ends are 1, 2, 3: 1|1|1|3
#   (14/3 | 2); any crossing split pays about 13.9 more per rank.
# - region 3 (layers 3-5, source 2; iteration 4): a 4-stage split must cross (two places to end
#   before layer 3), so every rank pays the hand-off; 1|3|1|1 gives 3 | 10/3 (+13.9 each), as
#   1|2|2|1 and 1|1|3|1, and is nearest the even split. The hand-off now goes rank 1 -> (the turn,
#   at layer 4) -> rank 1 -> rank 0 (layer 5).
LAYOUTS = {1: "V:Et|ttt|t|tL", 2: "V:Et|tt|t|ttL", 3: "V:Et|t|t|tttL", 4: "V:Et|ttt|t|tL"}


def test_v_rebalanced_run_matches_one_process(tmp_path):
    single = run_trainer(ARGS, tmp_path / "pp1")
    v = run_trainer([*ARGS, "--pp", "2", "--pipeline-schedule", "v-1f1b", "--epas-rebalance", "on"], tmp_path / "v", nproc=2)
    assert [s["sharing_layers"] for s in v.switches] == [[5], [4, 5], [3, 4, 5]]
    assert {r["iteration"]: r["layout"] for r in v.train_records} == LAYOUTS
    for switch in v.switches:  # layers changed rank at every switch, point to point
        assert switch["previous_layout"] == LAYOUTS[switch["iteration"] - 1] != switch["layout"]
        assert switch["switch_bytes_between_ranks"] > 0, switch
    assert "pipeline stages, rebalanced at every switch" in v.stdout
    for layout in set(LAYOUTS.values()):  # the start-up table lists the layout of every region
        assert f"--pipeline-layout {layout}" in v.stdout
    assert_close(v.losses, single.losses, 1e-5, "loss")
    assert_close(v.grad_norms, single.grad_norms, 1e-5, "grad norm")
    valid = lambda run: {(m["iteration"], m["region"]): m["lm_loss"] for m in run.metrics if m.get("kind") == "valid"}
    assert sorted(valid(single)) == [(2, 0), (2, 1), (4, 0), (4, 3)]
    assert_close(valid(v), valid(single), 1e-5, "validation per region")


SHAPE_12 = [arg if arg != "6" else "12" for arg in SHAPE]
ARGS_12 = [*ARGS[:ARGS.index("--num-layers")], *SHAPE_12, *ARGS[ARGS.index("--num-layers") + len(SHAPE):]]


@pytest.fixture(scope="module")
def single_12(tmp_path_factory):
    return run_trainer(ARGS_12, tmp_path_factory.mktemp("pp1_12") / "run")


@pytest.mark.parametrize("schedule", ["v-min", "v-half", "v-1f1b"])
def test_four_rank_v_runs_with_switches_match_one_process(schedule, single_12, tmp_path):
    """p = 4 (eight V stages of a 12-layer model): three switches rebalance the stages and move
    layers between ranks, the hand-off rows cross every boundary, the forward-only validation runs
    at region 0; every iteration equals the single-process run. Like every multi-process test it
    runs under NCCL's point-to-point rules (tests/epas_testing.py: child_environ)."""
    single = single_12
    v = run_trainer([*ARGS_12, "--pp", "4", "--pipeline-schedule", schedule, "--epas-rebalance", "on"], tmp_path / "v", nproc=4)
    assert [s["sharing_layers"] for s in v.switches] == [[11], [10, 11], [9, 10, 11]]
    assert any(s["layout"] != s["previous_layout"] and s["switch_bytes_between_ranks"] > 0 for s in v.switches)
    assert_close(v.losses, single.losses, 1e-5, "loss")
    assert_close(v.grad_norms, single.grad_norms, 1e-5, "grad norm")
    valid = lambda run: {(m["iteration"], m["region"]): m["lm_loss"] for m in run.metrics if m.get("kind") == "valid"}
    assert sorted(valid(single)) == [(2, 0), (2, 1), (4, 0), (4, 3)]
    assert_close(valid(v), valid(single), 1e-5, "validation per region")
