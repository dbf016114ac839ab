"""Bytes per decode step and the fixed-memory batch: by hand, and against a real model's weights."""

import pytest

from epas_megatron.inference.decode_cost import decode_bytes_per_step, max_batch_for_budget
from epas_megatron.sharing.schedule import layer_modes
from epas_testing import build


def test_bytes_per_step_by_hand(tiny_arch):
    # tiny_arch: h 64, 4 heads / 2 groups of 16, ffn 176, vocab 256; layers 2-3 share; batch 2,
    # context 10, fp32. Per computing layer: QKV 64*8*16 = 8192, norms 128, proj 4096, MLP
    # 3*64*176 = 33792; a sharing layer has V 64*2*16 = 2048 instead of the QKV. Final norm 64,
    # LM head 16384, two embedding rows 128: 16576 + 2*(8192+38016) + 2*(2048+38016) = 189120.
    modes = layer_modes(4, (2, 3))
    # K+V of one layer: 2 * b 2 * g 2 * c 10 * hn 16 * 4 B = 5120 B; P of reuse: b 2 * 4 heads * 10 * 4 B = 320 B.
    qk = decode_bytes_per_step(tiny_arch, modes, "qk", "qk", 2, 10, 4)
    assert (qk.weights, qk.kv_cache) == (189120 * 4, 4 * 5120)
    reuse = decode_bytes_per_step(tiny_arch, modes, "qk", "reuse", 2, 10, 4)
    assert (reuse.weights, reuse.kv_cache) == (189120 * 4, 2 * 5120 + 2 * (2560 + 320))
    # bf16: every term at 2 B, the probabilities too (the source hands P over in the model's dtype)
    reuse_bf16 = decode_bytes_per_step(tiny_arch, modes, "qk", "reuse", 2, 10, 2)
    assert (reuse_bf16.weights, reuse_bf16.kv_cache) == (189120 * 2, 2 * 2560 + 2 * (1280 + 160))
    baseline = decode_bytes_per_step(tiny_arch, layer_modes(4, ()), "qk", "qk", 2, 10, 4)
    assert baseline.weights == (16576 + 4 * (8192 + 38016)) * 4 and baseline.kv_cache == 4 * 5120
    # 'kv' sharing layers read Q (64*4*16 = 4096) and the source's K and V
    kv = decode_bytes_per_step(tiny_arch, modes, "kv", "qk", 2, 10, 4)
    assert (kv.weights, kv.kv_cache) == ((16576 + 2 * (8192 + 38016) + 2 * (4096 + 38016)) * 4, 4 * 5120)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_weight_bytes_equal_the_built_models_parameters(tiny_arch, share):
    from epas_megatron.model.attention import FrozenProjection

    model = build(tiny_arch, (2, 3), share=share)
    frozen = {id(p) for m in model.modules() if isinstance(m, FrozenProjection) for p in m.parameters()}
    table = model.embedding.word_embeddings.weight
    read = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in frozen and p is not table)
    batch = 3
    read += batch * tiny_arch.hidden_size * table.element_size()
    ours = decode_bytes_per_step(tiny_arch, layer_modes(4, (2, 3)), share, "qk", batch, 8, 4)
    assert ours.weights == read


def test_max_batch_for_budget():
    assert max_batch_for_budget(1000, 10, 10) == 10
    assert max_batch_for_budget(999, 10, 10) == 9
    assert max_batch_for_budget(99, 10, 10) == 0
