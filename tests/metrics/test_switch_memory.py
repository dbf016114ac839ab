"""The in-memory switch's transient: the memory model (``switch_transient_terms``) against torch's
CPU allocation counter around a real trainer's switch (tests/switch_memory_check.py), for the
plain fp32 optimizer, the mixed-precision one and the distributed one (bf16, the GPU's default;
fp32: its DDP copy phase); and the terms by hand. The same check runs against the CUDA
allocator in tests/gpu/test_gpu_memory_and_nccl.py."""

import pytest

from epas_megatron.metrics.memory_model import (
    LayerShape,
    RankMemorySettings,
    layer_parameters,
    qkv_parameters,
    rank_memory_bytes,
    switch_transient_terms,
)
from switch_memory_check import CONFIGURATIONS, measure_switch

UNMODELLED = 32 * 1024
"""Bytes the model leaves out of a switch: allocations smaller than any weight -- Adam's step
counters, the exchange's shard bookkeeping, scalars -- measured at 5.0-5.3 KiB in every
configuration here (h 64 to 512), whatever the model's size. The smallest modelled term (the
plain optimizer's new Adam moments of the switching layer's V projection: 128 KiB at this
shape) is four times this, so the check fails if any term is missing or miscounted (the merged
frozen Q/K rows that the switch held until its end, 160 KiB in bf16, were caught this way when
the switch started dropping them)."""


@pytest.mark.parametrize("precision,distributed", [*CONFIGURATIONS, ("fp32", True)],
                         ids=lambda value: {False: "plain", True: "distributed"}.get(value, value))
def test_switch_peak_equals_the_cpu_allocation_counter(precision, distributed, tmp_path):
    result = measure_switch(precision, distributed, tmp_path)
    model = result["model"]
    print(f"{precision} {'distributed' if distributed else 'plain'}: switch peak measured {result['peak']} B, "
          f"model {model['transient']:.0f} B; build measured {result['build_peak']} B, model "
          f"{max(model['build'], model['ddp_copy_peak']):.0f} B")
    assert abs(result["peak"] - model["transient"]) <= UNMODELLED, result
    # Up to the end of the build: new weights, gradient buffer, main weights (and the DDP copy).
    # Half precision makes each main weight as ``param.clone().float()``: one parameter's
    # w-byte copy for a moment, at most the largest parameter (the model leaves it out).
    clone = 0 if precision == "fp32" else 2 * max(512 * 256, 2 * 704 * 256)
    build = max(model["build"], model["ddp_copy_peak"])
    assert build - UNMODELLED <= result["build_peak"] <= build + clone + UNMODELLED, result
    # Which phase is the peak: the build for the plain optimizer (its Adam state is adopted), the
    # optimizer exchange for the others (new moments before the old go).
    assert (model["transient"] == model["build"]) == (precision == "fp32" and not distributed)


def test_switch_terms_by_hand():
    """One rank, 2 layers, layer 1 switches (``qk``), vocab 512, DP 2."""
    shape = LayerShape(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176, seq_length=32,
                       micro_batch_size=1)
    compute, _ = layer_parameters(shape, "compute")
    share, frozen = layer_parameters(shape, "share")
    qkv = qkv_parameters(shape)
    assert qkv == 64 * (4 + 2 * 2) * 16 and frozen == 64 * (4 + 2) * 16 and compute - qkv + 64 * 2 * 16 == share
    table = 512 * 64
    t_before = 2 * compute + 2 * table + 64
    t_after = compute + share + 2 * table + 64
    n_after = t_after + frozen
    terms = lambda **kw: switch_transient_terms(shape, ["compute"] * 2, ["compute", "share"], [0, 1], [0, 1], 0, 1,
                                                RankMemorySettings(vocab_size=512, dp=2, **kw))
    plain = terms()
    assert plain["build"] == 4 * n_after + 4 * t_after - 4 * t_before
    assert plain["optimizer_exchange"] == 4 * t_after - 4 * t_before + 8 * 64 * 2 * 16 + 8 * qkv
    assert plain["transient"] == plain["build"]
    mixed = terms(precision="bf16")
    # The old gradient buffer is released before the build (drop_gradients detaches the main
    # weights' .grad views of it too).
    assert mixed["build"] == 2 * n_after + 4 * t_after - 4 * t_before + 4 * t_after
    assert mixed["optimizer_exchange"] == 4 * t_after - 4 * t_before + 4 * t_after + 8 * t_after + 12 * qkv
    dist = terms(precision="bf16", distributed_optimizer=True)
    assert dist["ddp_copy_peak"] == 2 * n_after + 2 * t_after + 4 * t_after - 4 * t_before
    assert dist["optimizer_exchange"] == (2 * n_after + 4 * t_after - 4 * t_before + 4 * t_after / 2
                                          + 8 * t_after / 2 + 24 * qkv)
    assert dist["transient"] == dist["optimizer_exchange"]
    # Against the parameter state of the region before: the distributed optimizer's switch adds
    # about three quarters of it at this size (a step adds the activations; the switch adds this).
    state = rank_memory_bytes(shape, [["compute"] * 2], 0, 1, 1, RankMemorySettings(vocab_size=512, dp=2, precision="bf16",
                                                                                   distributed_optimizer=True))["parameters"]
    assert state == 2 * t_before + 4 * t_before + 12 * t_before // 2
    assert 0.7 * state < dist["transient"] < 0.8 * state


def test_a_layer_moving_stage_is_new_on_its_new_rank():
    """PP=2 re-layout at the switch: layer 1 moves from rank 0 to rank 1 while layer 3 switches on
    rank 1. Rank 0 holds the moved layer's old state to the end (no saving counted); rank 1
    allocates the moved layer's weights and, with the plain optimizer, its Adam moments."""
    shape = LayerShape(64, 4, 2, 176, 32, 1)
    settings = RankMemorySettings(vocab_size=512)
    roles_before, roles_after = ["compute"] * 4, ["compute"] * 3 + ["share"]
    compute, _ = layer_parameters(shape, "compute")
    stay = switch_transient_terms(shape, roles_before, roles_after, [2, 3], [2, 3], 1, 2, settings)
    moved = switch_transient_terms(shape, roles_before, roles_after, [2, 3], [1, 2, 3], 1, 2, settings)
    assert moved["new_moments"] - stay["new_moments"] == 8 * compute
    assert moved["optimizer_exchange"] - stay["optimizer_exchange"] == 4 * compute + 4 * compute + 8 * compute
    sender = switch_transient_terms(shape, roles_before, roles_after, [0, 1], [0], 0, 2, settings)
    assert sender["split_optimizer_state"] == 0 and sender["new_weights"] < switch_transient_terms(
        shape, roles_before, roles_after, [0, 1], [0, 1], 0, 2, settings)["new_weights"]
