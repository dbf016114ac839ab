"""Bytes per decode step and the fixed-memory batch: by hand, and against a real model's weights."""

import pytest

from epas_megatron.inference.decode_cost import decode_bytes_per_step, max_batch_for_budget
from epas_megatron.sharing.shape import layer_modes
from epas_testing import build


def test_bytes_per_step_by_hand(tiny_arch):
    # tiny_arch: h 64, 4 heads / 2 groups of 16, ffn 176, vocab 256; layers 2-3 share; batch 2,
    # context 10, fp32. Per computing layer: QKV 64*8*16 = 8192, norms 128, proj 4096, MLP
    # 3*64*176 = 33792; a sharing layer has V 64*2*16 = 2048 instead of the QKV. Final norm 64,
    # LM head 16384, two embedding rows 128: 16576 + 2*(8192+38016) + 2*(2048+38016) = 189120.
    modes = layer_modes(4, (2, 3))
    # K+V of one layer: 2 * b 2 * g 2 * c 10 * hn 16 * 4 B = 5120 B. Scores: s = b 2 * 4 heads * 10 = 80
    # per layer; a softmax layer in fp32 moves 4s (Q K^T) + 8s (scale) + 8s (mask) + 8s (softmax)
    # + 4s (P . V reads P) = 32s = 2560 B (the cast to fp32 is no copy); reuse reads P: 4s = 320 B.
    qk = decode_bytes_per_step(tiny_arch, modes, "qk", "qk", 2, 10, 4)
    assert (qk.weights, qk.kv_cache, qk.scores) == (189120 * 4, 4 * 5120, 4 * 2560)
    assert qk.total == 189120 * 4 + 4 * 5120 + 4 * 2560
    reuse = decode_bytes_per_step(tiny_arch, modes, "qk", "reuse", 2, 10, 4)
    assert (reuse.weights, reuse.kv_cache, reuse.scores) == (189120 * 4, 2 * 5120 + 2 * 2560, 2 * 2560 + 2 * 320)
    # bf16: weights and cache at 2 B; a softmax layer moves 4s + 8s + 8s + 8s + the cast (reads 4s,
    # writes 2s) + P . V's 2s = 36s = 2880 B; reuse reads the source's bf16 P, 2s = 160 B.
    reuse_bf16 = decode_bytes_per_step(tiny_arch, modes, "qk", "reuse", 2, 10, 2)
    assert (reuse_bf16.weights, reuse_bf16.kv_cache, reuse_bf16.scores) == (189120 * 2, 2 * 2560 + 2 * 1280, 2 * 2880 + 2 * 160)
    baseline = decode_bytes_per_step(tiny_arch, layer_modes(4, ()), "qk", "qk", 2, 10, 4)
    assert baseline.weights == (16576 + 4 * (8192 + 38016)) * 4 and (baseline.kv_cache, baseline.scores) == (4 * 5120, 4 * 2560)
    # 'kv' sharing layers read Q (64*4*16 = 4096), the source's K and V, and run their own softmax
    kv = decode_bytes_per_step(tiny_arch, modes, "kv", "qk", 2, 10, 4)
    assert (kv.weights, kv.kv_cache, kv.scores) == ((16576 + 2 * (8192 + 38016) + 2 * (4096 + 38016)) * 4, 4 * 5120, 4 * 2560)
    assert decode_bytes_per_step(tiny_arch, modes, "kv", "reuse", 2, 10, 4) == kv  # no reuse without the source's Q


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


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("share, attention", [("qk", "qk"), ("qk", "reuse"), ("kv", "qk")])
def test_score_bytes_follow_a_real_decode_step(tiny_arch, monkeypatch, share, attention):
    """The scores the model prices are the ones a real engine step makes: one ``probabilities``
    (the softmax path) per layer that runs the softmax, one ``attend`` (P . V) per layer, each
    over ``b x np x visible slots`` elements."""
    import torch

    from epas_megatron.inference import attention as attn_ops
    from epas_megatron.inference.engine import DecodeEngine

    made, read = [], []
    probabilities, attend = attn_ops.probabilities, attn_ops.attend
    monkeypatch.setattr(attn_ops, "probabilities", lambda *a, **k: made.append(probabilities(*a, **k)) or made[-1])
    monkeypatch.setattr(attn_ops, "attend", lambda probs, values: read.append(probs.numel()) or attend(probs, values))
    model = build(tiny_arch, (2, 3), share=share).eval()
    engine = DecodeEngine(model, attention)
    batch, context = 3, 9
    cache = engine.new_cache(batch, context + 1)
    for buffer in (cache.computing_keys, cache.computing_values, cache.sharing_values):
        buffer.normal_()
    cache.length = context
    with torch.no_grad():
        engine.forward(torch.zeros(batch, 1, dtype=torch.long), cache)
    elements = batch * tiny_arch.num_attention_heads * (context + 1)  # the step attends over context + 1 slots
    assert [p.numel() for p in made] == [elements] * len(made) and read == [elements] * tiny_arch.num_layers
    # fp32: each softmax path moves 4 + 8 + 8 + 8 bytes per element and its P . V reads 4 more; a
    # reusing layer's P . V reads the source's P, 4 bytes per element.
    priced = decode_bytes_per_step(tiny_arch, layer_modes(4, (2, 3)), share, attention, batch, context + 1, 4)
    assert priced.scores == len(made) * 28 * elements + len(read) * 4 * elements
    assert len(made) == (2 if attention == "reuse" else 4)
