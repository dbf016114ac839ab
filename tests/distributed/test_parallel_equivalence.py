"""TP=2 (with and without sequence parallelism), PP=2 (1F1B), PP=2 x VPP=2 and DP=2 runs (plain
or distributed optimizer) equal the single-process run from the same seed.

EPAS switching is on (layers 3, then 2-3 share from iterations 3 and 5), so this also checks that
sharing with TP=2 equals sharing with TP=1 and that the QK hand-off crosses pipeline stages
correctly. Tolerance 1e-5 relative on the loss and grad norm of every iteration (fp32).

Every run also validates at iterations 3 and 6 at regions 0, 1, the region in training and 3
(--eval-regions with untrained regions: layer 1 shares with layer 0 as the source), so the
evaluation of other regions -- modules built for the region on the training layout, weights
copied in memory -- is checked on every layout too, including hand-offs that cross the PP stage
boundary (regions 2 and 3) where training's does not yet.
"""

import pytest

from epas_testing import TINY, assert_close, run_trainer

pytestmark = pytest.mark.distributed

ARGS = [*TINY, "--train-iters", "6", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--epas-target-layers", "2", "--epas-interval", "2", "--epas-first-switch", "3",
        "--seed", "7", "--no-save-final",
        "--eval-interval", "3", "--eval-iters", "1", "--eval-regions", "0,1,max,3", "--eval-untrained-regions",
        # Large init so attention is far from uniform: a wrong Q/K hand-off then changes the loss.
        "--init-method-std", "0.2"]

VARIANTS = {
    "tp2": ["--tp", "2"],
    "tp2_sequence_parallel": ["--tp", "2", "--sequence-parallel"],
    "pp2": ["--pp", "2", "--epas-rebalance", "off"],
    "pp2_vpp2": ["--pp", "2", "--vpp", "2", "--epas-rebalance", "off"],
    # V placement (rank 0: layers 0 and 3, rank 1: 1 and 2), the project's executor: the hand-off
    # of region [2, 3] goes rank 1 -> turn -> rank 0; of [1, 2, 3] at evaluation, rank 0 -> rank 1 too.
    "pp2_v_1f1b": ["--pp", "2", "--pipeline-schedule", "v-1f1b"],
    # The split backward (W passes run the deferred weight-gradient GEMMs), same placement.
    "pp2_v_half": ["--pp", "2", "--pipeline-schedule", "v-half"],
    "pp2_v_min": ["--pp", "2", "--pipeline-schedule", "v-min"],
    # Recompute under the split backward: W's GEMMs take the recomputed inputs.
    "pp2_v_min_full_recompute": ["--pp", "2", "--pipeline-schedule", "v-min", "--recompute", "full", "--recompute-num-layers", "1"],
    "pp2_v_half_selective_recompute": ["--pp", "2", "--pipeline-schedule", "v-half", "--recompute", "selective",
                                       "--recompute-modules", "core_attn", "mlp"],
    "dp2_overlap_grad_reduce": ["--overlap-grad-reduce"],
    "dp2_distributed_optimizer": ["--use-distributed-optimizer"],
    "dp2_distributed_optimizer_overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_trainer(ARGS, tmp_path_factory.mktemp("single") / "run")


@pytest.fixture(scope="module")
def parallel_runs(tmp_path_factory):
    """The 2-process run of each variant (default --epas-switch-mode, memory), made once."""
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = run_trainer([*ARGS, *VARIANTS[name]], tmp_path_factory.mktemp(name) / "run", nproc=2)
        return runs[name]

    return get


FOUR_RANK_VARIANTS = {
    # V with TP=2 and sequence parallelism: the deferred GEMMs gather the sequence again in W.
    "tp2_sp_pp2_v_min": ["--tp", "2", "--sequence-parallel", "--pp", "2", "--pipeline-schedule", "v-min"],
    # V with DP=2 and the distributed optimizer: deferred gradients reach the reduce-scatter.
    "dp2_distributed_optimizer_pp2_v_half": ["--pp", "2", "--pipeline-schedule", "v-half", "--use-distributed-optimizer"],
}


@pytest.mark.parametrize("name", list(FOUR_RANK_VARIANTS))
def test_four_rank_v_runs_match_single_process(name, reference, tmp_path):
    run = run_trainer([*ARGS, *FOUR_RANK_VARIANTS[name]], tmp_path / "run", nproc=4)
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    assert_close(run.losses, reference.losses, 1e-5, f"{name} loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-5, f"{name} grad norm")
    assert_close(valid_losses(run), valid_losses(reference), 1e-5, f"{name} validation per region")


def valid_losses(run):
    return {(m["iteration"], m["region"]): m["lm_loss"] for m in run.metrics if m.get("kind") == "valid"}


def test_reference_switches(reference):
    assert [s["iteration"] for s in reference.switches] == [3, 5]
    assert [s["sharing_layers"] for s in reference.switches] == [[3], [2, 3]]
    assert sorted(reference.losses) == list(range(1, 7))
    assert sorted(valid_losses(reference)) == [(3, 0), (3, 1), (3, 3), (6, 0), (6, 1), (6, 2), (6, 3)]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parallel_run_matches_single_process(name, reference, parallel_runs):
    run = parallel_runs(name)
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    assert_close(run.losses, reference.losses, 1e-5, f"{name} loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-5, f"{name} grad norm")
    assert_close(valid_losses(run), valid_losses(reference), 1e-5, f"{name} validation per region")


def same_run(a, b) -> bool:
    """Bit-identical: every loss, grad norm and validation loss equal as floats."""
    return (a.losses, a.grad_norms, valid_losses(a)) == (b.losses, b.grad_norms, valid_losses(b))


@pytest.mark.parametrize("name", ["tp2", "pp2_vpp2", "pp2_v_1f1b", "pp2_v_min"])
def test_switch_modes_are_bit_identical(name, parallel_runs, tmp_path):
    """--epas-switch-mode memory (the default, what every run above used) and checkpoint carry
    the state through the switches at 3 and 5 bit for bit, under TP=2, PP=2 x VPP=2 and V placement. One place
    per layout kind: one process and DP=2 with the distributed optimizer are compared in
    tests/training/test_switch_modes.py (bf16 and fp16, whose switches carry fp32 main weights and
    a loss scale too), PP=2 with re-layouts in test_rebalance.py."""
    memory = parallel_runs(name)
    checkpoint = run_trainer([*ARGS, *VARIANTS[name], "--epas-switch-mode", "checkpoint"], tmp_path / "run", nproc=2)
    assert [s["switch_mode"] for s in memory.switches] == ["memory", "memory"]
    assert [s["switch_mode"] for s in checkpoint.switches] == ["checkpoint", "checkpoint"]
    assert all(s["switch_bytes_written"] == 0 for s in memory.switches)
    assert all(s["switch_bytes_written"] > 0 for s in checkpoint.switches)
    assert same_run(memory, checkpoint), (memory.losses, checkpoint.losses)


@pytest.mark.parametrize("recompute", [["--recompute", "full", "--recompute-num-layers", "1"],
                                       ["--recompute", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
                                       ["--recompute", "selective"],
                                       ["--recompute", "selective", "--recompute-modules", "core_attn", "mlp"]],
                         ids=["full_uniform_1", "full_block_3", "selective", "selective_core_attn_mlp"])
def test_activation_recompute_matches(recompute, reference, tmp_path):
    """Recompute groups that split the source from its sharing layers replay the same hand-off."""
    run = run_trainer([*ARGS, *recompute], tmp_path / "run")
    assert_close(run.losses, reference.losses, 1e-6, "recompute loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-6, "recompute grad norm")


@pytest.fixture(scope="module")
def kv_reference(tmp_path_factory):
    return run_trainer([*ARGS, "--epas-share", "kv"], tmp_path_factory.mktemp("kv") / "run")


def test_kv_variant_differs_from_qk_after_the_first_switch(kv_reference, reference):
    assert all(kv_reference.losses[i] == reference.losses[i] for i in (1, 2))
    assert all(kv_reference.losses[i] != reference.losses[i] for i in (4, 5, 6))


@pytest.mark.parametrize("extra", [["--tp", "2"], ["--pp", "2", "--epas-rebalance", "off"]], ids=["tp2", "pp2"])
def test_kv_sharing_variant_is_layout_independent(kv_reference, tmp_path, extra):
    """--epas-share kv (own Q, source's K and V) gives the same run on any layout."""
    run = run_trainer([*ARGS, "--epas-share", "kv", *extra], tmp_path / "run", nproc=2)
    assert_close(run.losses, kv_reference.losses, 1e-5, "kv loss")
    assert_close(run.grad_norms, kv_reference.grad_norms, 1e-5, "kv grad norm")


def test_pipeline_with_full_recompute(reference, tmp_path):
    run = run_trainer([*ARGS, "--pp", "2", "--epas-rebalance", "off", "--recompute", "full", "--recompute-num-layers", "1"],
                      tmp_path / "run", nproc=2)
    assert_close(run.losses, reference.losses, 1e-5, "pp2 recompute loss")
    assert_close(run.grad_norms, reference.grad_norms, 1e-5, "pp2 recompute grad norm")


@pytest.mark.parametrize("extra", [["--tp", "2"], ["--tp", "2", "--sequence-parallel"]], ids=["tp2", "tp2_sequence_parallel"])
def test_blocks_with_blended_switches_under_tp2(extra, tmp_path):
    """Two sharing blocks (layer 3 from iteration 3, source 2; layer 1 from 6, source 0) reached
    through blended switches (iterations 1-2 and 4-5): TP=2 equals one process -- the blocks'
    hand-offs and the blend act on each rank's heads."""
    args = [*TINY, "--train-iters", "7", "--global-batch-size", "4", "--micro-batch-size", "1", "--epas-target-layers", "2",
            "--epas-interval", "3", "--epas-blocks", "2", "--epas-switch-ramp", "2", "--seed", "7", "--no-save-final",
            "--init-method-std", "0.2"]
    single = run_trainer(args, tmp_path / "single")
    tp = run_trainer([*args, *extra], tmp_path / "tp", nproc=2)
    for run in (single, tp):
        assert [(s["iteration"], s["sharing_layers"]) for s in run.switches] == [(3, [3]), (6, [1, 3])]
        assert [r["switch_ramp_weight"] for r in run.train_records] == [0.5, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0]
    assert_close(tp.losses, single.losses, 1e-5, "loss")
    assert_close(tp.grad_norms, single.grad_norms, 1e-5, "grad norm")


@pytest.mark.parametrize("precision, rel", [("fp32", 1e-5), ("bf16", 2e-3)])
def test_tied_embeddings_under_pp2_match_one_process(precision, rel, reference, tmp_path):
    """An LM head tied to the embedding (``--no-untie-embeddings-and-output-weights``) on PP=2:
    the last stage holds Megatron's copy of the embedding, made equal to it at the start and kept
    equal by the all-reduce of both copies' gradients; stages are rebalanced at each switch (the
    default), layers moving between the stages in memory. The run equals one process holding the
    one matrix -- in fp32 to rounding; in bf16 (fp32 main weights) the two gradient sums round
    differently (measured: losses within 2e-4, grad norms within 1e-3 relative)."""
    args = [*ARGS, "--no-untie-embeddings-and-output-weights", "--precision", precision]
    single = run_trainer(args, tmp_path / "single")
    pipelined = run_trainer([*args, "--pp", "2"], tmp_path / "pp2", nproc=2)
    assert single.losses[1] != reference.losses[1]  # the tie is real: another model than the untied one
    for run in (single, pipelined):
        assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    assert_close(pipelined.losses, single.losses, rel, f"{precision} tied pp2 loss")
    assert_close(pipelined.grad_norms, single.grad_norms, 5 * rel if precision == "bf16" else rel,
                 f"{precision} tied pp2 grad norm")
    assert_close(valid_losses(pipelined), valid_losses(single), rel, f"{precision} tied pp2 validation")


def test_a_v_placement_checkpoint_resumes_under_1f1b_and_back(reference, tmp_path):
    """Layers are keyed by their global id under every placement: a V run's checkpoint of
    iteration 4 resumed under Megatron's 1F1B, a 1F1B checkpoint resumed under V, and a V-Min
    checkpoint resumed under Megatron's interleaved schedule continue the single-process run
    (iterations 5 and 6)."""
    args = [*ARGS, "--pp", "2", "--save-interval", "4"]
    pairs = ((["--pipeline-schedule", "v-1f1b"], []), ([], ["--pipeline-schedule", "v-1f1b"]),
             (["--pipeline-schedule", "v-min"], ["--vpp", "2", "--epas-rebalance", "off"]))
    for index, (first, then) in enumerate(pairs):
        out = tmp_path / f"pair-{index}"
        run_trainer([*args, *first, "--exit-interval", "4"], out, nproc=2)
        resumed = run_trainer([*args, *then, "--load", str(out / "checkpoints")], out, nproc=2)
        tail = {i: resumed.losses[i] for i in (5, 6)}
        assert_close(tail, {i: reference.losses[i] for i in (5, 6)}, 1e-5, f"resumed loss ({first} -> {then})")
