"""epas-bench switch: the measured record (bytes checked against the model's own state size) and
the 7B prediction's arithmetic (checked by hand and against LLaMA-2-7B's published size)."""

import json
import subprocess
import sys

import pytest

from epas_megatron.bench.switch_model import ClusterAssumptions, llama_parameters, predict_switch


def test_llama_parameter_count_matches_llama2_7b_and_a_built_model(single_process):
    # LLaMA-2-7B: 6,738,415,616 parameters (32 layers, h 4096, ffn 11008, vocab 32000, untied).
    from epas_megatron.config.presets import get_preset
    from epas_megatron.model.architecture import LlamaArchitecture, architecture_from_preset
    from epas_testing import build

    assert llama_parameters(architecture_from_preset(get_preset("7b")))[0] == 6_738_415_616
    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, 64)
    model = build(arch)
    total, layer = llama_parameters(arch)
    assert total == sum(p.numel() for p in model.parameters())
    assert layer == sum(p.numel() for p in model.decoder.layers[0].parameters())


def test_prediction_by_hand():
    a = ClusterAssumptions(gpus_per_node=8, fs_write_gb_s_per_node=1.0, fs_read_gb_s_per_node=2.0, intra_node_gb_s=10.0,
                           inter_node_gb_s=1.0, hbm_copy_gb_s=100.0, rebuild_s=1.0, mfu=0.5, peak_tflops=100.0)
    p = predict_switch(1_000_000_000, 10_000_000, tp=1, pp=2, dp=2, moved_layers=2, qkv_params=3_000_000,
                       iteration_flops=4e15, a=a)
    shard = 0.5e9  # parameters per model-parallel rank
    gather = 12 * shard * 0.5 / 10e9  # checkpoint: half of the rank's fp32 optimizer state arrives from its DP peer
    assert p["seconds_checkpoint"] == pytest.approx(gather + 14e9 / 1e9 + 14e9 * 2 / 2e9 + 1.0)
    # memory: bf16 weights + the rank's half of the fp32 state, read and written; two moved layers;
    # the switching layer's fused QKV state assembled over the DP link
    assert p["seconds_memory"] == pytest.approx(2 * (2 + 6) * shard / 100e9 + 14 * 10_000_000 * 2 / 10e9 + 12 * 3_000_000 / 10e9 + 1.0)
    assert p["iteration_s"] == pytest.approx(4e15 / (4 * 100e12 * 0.5))
    assert p["bytes_written_memory"] == 0 and p["bytes_written_checkpoint"] == 14e9


@pytest.fixture(scope="module")
def small_bench():
    # `small` (19M parameters, 76 MB of fp32 weights): large enough that memory figures stand
    # above the allocator's noise, small enough for CI (about 15 s).
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "switch", "--preset", "small", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("BENCH ")
    return json.loads(proc.stdout.strip().splitlines()[-1][6:]), proc.stdout


def test_switch_bench_record(small_bench):
    record, stdout = small_bench
    for key in ("seconds_memory", "seconds_checkpoint", "bytes_written_memory", "bytes_written_checkpoint"):
        assert key in record
    assert record["seconds_memory"] > 0 and record["seconds_checkpoint"] > 0
    # The checkpoint holds at least the fp32 weights and both Adam moments; memory mode writes nothing.
    assert record["bytes_written_checkpoint"] >= 3 * record["weight_bytes"]
    assert record["bytes_written_memory"] < 4096
    assert record["cost_iterations_memory"] > 0  # (seconds / step time: the bench's own division, not re-checked)
    assert [row["gpus"] for row in record["prediction_7b"]] == [8, 32]
    assert "| seconds per switch |" in stdout and "prediction, LLaMA-7B" in stdout


def test_switch_peak_memory_is_a_training_steps_within_the_stated_margins(small_bench):
    """Resident-set high-water mark during the switch, above the resident set before it, against
    the same figure for a training step. Stated margins: the in-memory switch (old tensors
    adopted, never copied) within a quarter of the weights above a step -- measured ~0 --; the
    checkpoint round trip within 2.5x the weights (Megatron's row split/fuse of fused QKV and FC1
    while saving and loading; measured 2.1x at 350m)."""
    record, _ = small_bench
    weights = record["weight_bytes"]
    assert record["peak_extra_bytes_memory"] <= max(record["step_peak_extra_bytes_memory"], 0) + 0.25 * weights
    assert record["peak_extra_bytes_checkpoint"] <= max(record["step_peak_extra_bytes_checkpoint"], 0) + 2.5 * weights
