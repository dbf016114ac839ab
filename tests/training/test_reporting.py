"""The pure parts of the trainer's reporting (epas_megatron.training.reporting): the FLOPs of an
iteration worked out by hand for a tiny model, the switch's console line and metrics record, the
MFU peak's name."""

import pytest
import torch

from epas_megatron.sharing.shape import LayerMode
from epas_megatron.training.reporting import iteration_flops, peak_name, switch_line, switch_record
from epas_testing import model_shape

# s = 4, h = 8, 2 heads of 4, 1 KV group (K/V width 4), F = 16, V = 32. A computing layer, Megatron's
# convention: Q 2*4*8*8 = 512, K = V = 2*4*8*4 = 256, scores = probs.V = 2*4*4*8 / 2 = 128,
# out 512, MLP 3*2*4*8*16 = 3072 -> 4864; LM head 2*4*8*32 = 2048.
SHAPE = model_shape(num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=16,
                    vocab_size=32, seq_length=4)
C, SRC, SH = LayerMode.COMPUTE, LayerMode.SOURCE, LayerMode.SHARE


def test_flops_of_an_iteration_by_hand():
    # 3 x (fwd) x global batch 3
    assert iteration_flops(SHAPE, [C, C], "qk", 3) == 9 * (2048 + 2 * 4864)
    assert iteration_flops(SHAPE, [SRC, SH], "qk", 3) == 9 * (2048 + 4864 + 4864 - 512 - 256)  # no Q/K projections
    assert iteration_flops(SHAPE, [SRC, SH], "kv", 3) == 9 * (2048 + 4864 + 4864 - 256 - 256)  # no K/V projections


def test_flops_of_an_iteration_with_kept_tokens_by_hand():
    # Both layers keep 2 tokens: at s = 2, Q 256, K = V = 128, scores = probs.V = 32, out 256, MLP 1536 -> 2368.
    # The source still projects Q/K/V for all 4 tokens (its projections 512 at s = 2, 1024 at s = 4); the
    # sharing layer skips Q/K (256 + 128); the LM head sees every token.
    source, sharing = 2368 - 512 + 1024, 2368 - 256 - 128
    assert iteration_flops(SHAPE, [SRC, SH], "qk", 3, [2, 2]) == 9 * (2048 + source + sharing)
    assert iteration_flops(SHAPE, [C, C], "qk", 3, [4, 2]) == 9 * (2048 + 4864 + 2368)
    assert iteration_flops(SHAPE, [C, C], "qk", 3, [4, 4]) == iteration_flops(SHAPE, [C, C], "qk", 3)


INFO = {"seconds": 1.234, "layout": "t|t", "previous_layout": "tt|", "mode": "memory", "bytes_written": 0,
        "bytes_between_ranks": 100}


def test_switch_line():
    assert switch_line(6, (2, 3), (1,), INFO, 2.5) == ("EPAS switch at iteration 6: sharing layers [2, 3] (source layer 1); "
                                                    "in-memory rebuild took 1.23s (= 2.5 iterations); pipeline layout tt| -> t|t")
    staged = {**INFO, "mode": "checkpoint", "layout": "tt|", "bytes_written": 10}
    del staged["bytes_between_ranks"]
    assert switch_line(1, (3,), (2,), staged, None) == ("EPAS switch at iteration 1: sharing layers [3] (source layer 2); "
                                                     "save/rebuild/load took 1.23s")


def test_switch_record():
    assert switch_record(6, (2, 3), (1,), INFO, 2.5) == {
        "kind": "switch", "iteration": 6, "sharing_layers": [2, 3], "source_layer": 1, "source_layers": [1],
        "layout": "t|t", "previous_layout": "tt|",
        "switch_seconds": 1.234, "switch_mode": "memory", "switch_bytes_written": 0, "switch_bytes_between_ranks": 100,
        "switch_cost_iterations": 2.5}
    staged = {key: value for key, value in INFO.items() if key != "bytes_between_ranks"}
    assert switch_record(6, (2, 3), (1,), staged, None)["switch_bytes_between_ranks"] is None


def test_switch_line_and_record_with_several_blocks():
    line = switch_line(8, (3, 4, 5, 9, 10, 11), (2, 8), INFO, None)
    assert line.startswith("EPAS switch at iteration 8: sharing layers [3, 4, 5, 9, 10, 11] (source layers 2, 8); ")
    record = switch_record(8, (3, 4, 5, 9, 10, 11), (2, 8), INFO, None)
    assert record["source_layers"] == [2, 8] and record["source_layer"] == 8  # the deepest block's


def test_peak_name(monkeypatch):
    assert peak_name("h100-sxm-bf16") == "h100-sxm-bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_name(None) == "cpu"


@pytest.mark.parametrize("modes", [[C], [C, C, C]])
def test_one_mode_per_layer(modes):
    with pytest.raises(ValueError, match="one mode and one token count per layer"):
        iteration_flops(SHAPE, modes, "qk", 1)


def test_pipeline_note_names_the_v_stages(tmp_path):
    """The start-up line under a V schedule: its stages' layers when fixed (even, or
    --pipeline-layout V:...), that they are chosen per region when rebalanced."""
    from epas_megatron.config.cli import parse_config
    from epas_megatron.runtime.distributed import ParallelDims
    from epas_megatron.training.reporting import pipeline_note
    from epas_megatron.validation import resolve_run

    def note(*flags):
        cfg = parse_config(["--preset", "tiny", "--num-layers", "6", "--pp", "2", "--pipeline-schedule", "v-1f1b",
                            "--global-batch-size", "8", "--output-dir", str(tmp_path / "run"), *flags])
        return pipeline_note(resolve_run(cfg, world_size=2, cuda=False), ParallelDims(2, 0, 1, 2, 1, 2))

    assert note("--epas-rebalance", "off") == " (v-1f1b, V placement: 2|2|1|1 layers per stage)"
    assert note("--pipeline-layout", "V:Ett|t|t|ttL") == " (v-1f1b, V placement: 2|1|1|2 layers per stage)"
    assert note() == " (v-1f1b, V placement: 4 stages, rebalanced for every region)"
