"""V placement (model/v_placement.py, model/v_layout.py) run by the pipeline executor with the
``v-1f1b``, ``v-half`` and ``v-min`` action lists on two gloo ranks (the last two with the
weight-gradient GEMMs deferred to their W passes, model/weight_grad.py), against Megatron-Core's 1F1B on its own placement
(itself equal to one process: tests/distributed): same losses, gradient norms and evaluation;
each chunk numbers its layers globally, so its checkpoint keys are the other layouts'. And the
placement's pure parts."""

from pathlib import Path

import pytest

from epas_megatron.model.v_placement import even_v_stage_sizes, v_chunk, v_rank, v_stage
from epas_testing import assert_close, json_lines, run_script


@pytest.fixture(scope="module")
def results():
    proc = run_script(Path(__file__).parent / "scripts" / "executor_v.py", nproc=2, timeout=600)
    return {row["case"]: row for row in json_lines(proc.stdout, "RESULT")}


@pytest.mark.distributed
@pytest.mark.parametrize("case, rel", [("plain", 1e-6), ("handoff", 1e-6), ("handoff_bf16", 1e-6), ("handoff_fp16", 1e-6),
                                        ("handoff_untagged", 1e-6), ("handoff_v-half", 1e-6), ("handoff_v-min", 1e-6),
                                        ("handoff_bf16_v-min", 1e-6), ("handoff_fp16_v-half", 1e-6),
                                        ("handoff_v-min_untagged", 1e-6)])
def test_v_schedules_equal_megatrons_1f1b(results, case, rel):
    """Rank 0 holds layers 0 and 3 (embedding, and head with loss), rank 1 layers 1 and 2 (the
    turn); with layers 1-3 sharing, the hand-off goes rank 0 -> rank 1 -> (turn) -> rank 0. The
    same micro-batches: the losses are equal to fp32 rounding (the gradient norm sums the chunks
    in another order). Under v-half and v-min every trainable linear's weight gradient was
    deferred and computed by a W pass: per micro-batch 4 per layer (QKV or the sharing layer's
    own V, output projection, fc1, fc2; frozen Q/K rows have none) and the LM head's, 9 on rank
    0 (layers 0, 3, head) and 8 on rank 1, for 4 micro-batches x 3 iterations; none under v-1f1b."""
    row = results[case]
    split = "v-half" in case or "v-min" in case
    assert row["deferred_gemms_per_rank"] == ([9 * 4 * 3, 8 * 4 * 3] if split else [0, 0])
    for iteration, (v, megatron) in enumerate(zip(row["v"], row["megatron"]), start=1):
        assert_close({"loss": v[0], "grad_norm": v[1]}, {"loss": megatron[0], "grad_norm": megatron[1]}, rel, f"{case} {iteration}")
    assert row["valid"][0] == pytest.approx(row["valid"][1], rel=rel)
    assert row["v"][-1][0] < row["v"][0][0]  # it learns (fp16: its steps are not all skipped)
    assert row["layers_per_rank"] == [[[0], [3]], [[1], [2]]]
    assert row["layer_keys_per_rank"] == [[0, 3], [1, 2]]  # checkpoint keys: the global layer ids


def test_v_placement_by_hand():
    assert [(v_rank(s, 3), v_chunk(s, 3)) for s in range(6)] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    assert [v_stage(r, c, 3) for r in range(3) for c in (0, 1)] == [0, 5, 1, 4, 2, 3]
    assert even_v_stage_sizes(22, 4) == (3, 3, 3, 3, 3, 3, 2, 2) and sum(even_v_stage_sizes(22, 4)) == 22


def test_megatrons_layer_offsets_follow_the_v_layout():
    """What Megatron-Core's layers ask a layout (offset and count of a chunk's decoder layers),
    answered in V order: 10 layers in stages of 2, 1, 3, 1, 2, 1 over 3 ranks."""
    from megatron.core.transformer.enums import LayerType

    from epas_megatron.model.v_layout import VPipelineLayout

    layout = VPipelineLayout((2, 1, 3, 1, 2, 1), 3)
    starts = [0, 2, 3, 6, 7, 9]  # stage s starts after the stages before it in V order
    for rank in range(3):
        for chunk in (0, 1):
            stage = v_stage(rank, chunk, 3)
            assert layout.get_layer_offset(LayerType.decoder, vp_stage=chunk, pp_rank=rank) == starts[stage]
            assert layout.get_num_layers_to_build(LayerType.decoder, vp_stage=chunk, pp_rank=rank) == (2, 1, 3, 1, 2, 1)[stage]
    assert layout.is_first_stage(0, 0) and layout.is_last_stage(0, 1) and not layout.is_last_stage(2, 1)
    assert layout.virtual_pipeline_model_parallel_size == 2 and str(layout) == "V:Ett|t|ttt|t|tt|tL"
    assert layout.validate_layer_layout(10, None) is False
    with pytest.raises(ValueError, match="holds 10 decoder layers, the model 12"):
        layout.validate_layer_layout(12, None)


def test_v_plans_refuse_what_they_cannot_build():
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan

    arch = LlamaArchitecture(4, 64, 4, 2, 176, 256, 32)
    with pytest.raises(ValueError, match="not a split of 4 layers over 2 x pp = 4 stages"):
        BuildPlan.for_region(arch, pp=2, v_stage_sizes=(2, 1, 1, 1))
    with pytest.raises(ValueError, match="needs pp >= 2 and no vpp"):
        BuildPlan.for_region(arch, pp=2, vpp=2, v_stage_sizes=(1, 1, 1, 1))
    with pytest.raises(ValueError, match="tied embeddings are not supported there yet"):
        BuildPlan.for_region(LlamaArchitecture(4, 64, 4, 2, 176, 256, 32, tie_embeddings=True), pp=2, v_stage_sizes=(1, 1, 1, 1))


@pytest.fixture(scope="module")
def four_rank_results():
    proc = run_script(Path(__file__).parent / "scripts" / "executor_v4.py", nproc=4, timeout=600)
    return {(row["schedule"], row["microbatches"]): row for row in json_lines(proc.stdout, "RESULT")}


@pytest.mark.distributed
@pytest.mark.parametrize("microbatches", [4, 8], ids=["m=p", "m=2p"])
@pytest.mark.parametrize("schedule", ["v-1f1b", "v-half", "v-min"])
def test_v_schedules_at_p4_equal_megatrons_1f1b(four_rank_results, schedule, microbatches):
    """p = 4, eight layers one per V stage, layers 3-7 sharing: the hand-off crosses rank 2 -> 3
    by p2p, the turn on rank 3, and every boundary back to rank 0. Losses, gradient norms and
    the forward-only loss equal Megatron-Core's 1F1B on its placement to fp32 rounding."""
    row = four_rank_results[(schedule, microbatches)]
    assert len(row["v"]) == len(row["megatron"]) == 3
    for iteration, (v, megatron) in enumerate(zip(row["v"], row["megatron"]), start=1):
        assert_close({"loss": v[0], "grad_norm": v[1]}, {"loss": megatron[0], "grad_norm": megatron[1]}, 1e-6,
                     f"{schedule} m={microbatches} {iteration}")
    assert row["v_valid"] == pytest.approx(row["megatron_valid"], rel=1e-6)
