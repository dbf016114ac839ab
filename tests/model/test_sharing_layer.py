"""QK/KV sharing against an independent plain-PyTorch LLaMA (tests/model/llama_reference.py).

Weights come from our model through the Hugging Face mapping, which test_hf_reference.py checks
against transformers' own LlamaForCausalLM.
"""

import pytest
import torch

import llama_reference as ref
from epas_megatron.convert.hf_llama import strip_extra_state
from epas_testing import assert_same_gradient, build, per_token_loss, reference_weights

pytestmark = pytest.mark.usefixtures("single_process")


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("sharing, exclude_last", [((3,), 0), ((2, 3), 0), ((1, 2, 3), 0), ((1, 2), 1), ((2,), 1), ((1,), 2)])
def test_model_with_sharing_matches_reference(tiny_arch, sharing, exclude_last, share):
    """With --epas-exclude-last the layers after the region compute their own Q/K (the hand-off
    passes through them unused)."""
    from epas_megatron.model.attention import split_qkv_rows
    from epas_megatron.sharing.shape import LayerMode

    torch.manual_seed(0)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 24))
    labels = torch.randint(0, tiny_arch.vocab_size, (2, 24))
    position_ids = torch.arange(24).unsqueeze(0).expand(2, -1)
    model = build(tiny_arch, sharing, share=share, exclude_last=exclude_last)
    tail = tuple(range(tiny_arch.num_layers - exclude_last, tiny_arch.num_layers))
    assert [model.decoder.layers[i].epas_mode for i in tail] == [LayerMode.COMPUTE] * exclude_last

    ours = model(tokens, position_ids, None, labels=labels)  # [b, s] per-token loss
    ours.sum().backward()

    hf, w = reference_weights(model, tiny_arch, requires_grad=True)
    expected = per_token_loss(ref.forward(w, tokens, tiny_arch.num_layers, 4, 2, set(sharing), share), labels)
    expected.sum().backward()

    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    if exclude_last:  # a region of the same size that includes the last layer computes something else
        deep = set(range(tiny_arch.num_layers - len(sharing), tiny_arch.num_layers))
        other = per_token_loss(ref.forward(w, tokens, tiny_arch.num_layers, 4, 2, deep, share), labels)
        assert not torch.allclose(ours, other, rtol=1e-4, atol=1e-4)
    # Gradients reach the source layer's Q/K (or K/V) through the sharing layers (no detach), and
    # the layers after the region train all of their Q, K and V ...
    for layer in (sharing[0] - 1, *tail):
        qkv_grad = model.decoder.layers[layer].self_attention.linear_qkv.weight.grad
        got = split_qkv_rows(qkv_grad, ("q", "k", "v"), 2, 2, 16)
        for part in "qkv":
            assert_same_gradient(got[part], hf[f"model.layers.{layer}.self_attn.{part}_proj.weight"].grad)
    # ... and each sharing layer its own projection.
    own = "v" if share == "qk" else "q"
    for layer in sharing:
        attention = model.decoder.layers[layer].self_attention
        assert_same_gradient(attention.own_projection.weight.grad, hf[f"model.layers.{layer}.self_attn.{own}_proj.weight"].grad)
        assert attention.frozen_projection.weight.grad is None


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("num_layers, blocks, sharing, sources", [
    (4, 2, (1, 3), (0, 2)),               # spans 0-1 | 2-3
    (6, 2, (1, 2, 4, 5), (0, 3)),         # spans 0-2 | 3-5
    (6, 2, (2, 4, 5), (1, 3)),            # mid-growth: the deeper block one layer ahead
    (6, 3, (1, 3, 5), (0, 2, 4)),         # spans 0-1 | 2-3 | 4-5
])
def test_several_blocks_match_reference(tiny_arch, num_layers, blocks, sharing, sources, share):
    """--epas-blocks: each block reuses the Q/K (K/V) of its own source, the reference's 'last
    computing layer before it'; a negative control: one block of the same size computes something else."""
    import dataclasses

    from epas_megatron.model.attention import split_qkv_rows
    from epas_megatron.sharing.shape import LayerMode

    arch = dataclasses.replace(tiny_arch, num_layers=num_layers)
    torch.manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (2, 24))
    labels = torch.randint(0, arch.vocab_size, (2, 24))
    position_ids = torch.arange(24).unsqueeze(0).expand(2, -1)
    model = build(arch, sharing, share=share, blocks=blocks)
    assert tuple(i for i, layer in enumerate(model.decoder.layers) if layer.epas_mode == LayerMode.SOURCE) == sources

    ours = model(tokens, position_ids, None, labels=labels)  # [b, s] per-token loss
    ours.sum().backward()
    hf, w = reference_weights(model, arch, requires_grad=True)
    expected = per_token_loss(ref.forward(w, tokens, num_layers, 4, 2, set(sharing), share), labels)
    expected.sum().backward()
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    one_block = set(range(num_layers - len(sharing), num_layers))
    assert not torch.allclose(ours, per_token_loss(ref.forward(w, tokens, num_layers, 4, 2, one_block, share), labels),
                              rtol=1e-4, atol=1e-4)
    own = "v" if share == "qk" else "q"
    for layer in sharing:
        attention = model.decoder.layers[layer].self_attention
        assert_same_gradient(attention.own_projection.weight.grad, hf[f"model.layers.{layer}.self_attn.{own}_proj.weight"].grad)
    for layer in sources:  # every source receives its own block's gradients through its Q/K (K/V)
        got = split_qkv_rows(model.decoder.layers[layer].self_attention.linear_qkv.weight.grad, ("q", "k", "v"), 2, 2, 16)
        for part in "qkv":
            assert_same_gradient(got[part], hf[f"model.layers.{layer}.self_attn.{part}_proj.weight"].grad)


def test_sharing_layer_output_matches_reference_attention(tiny_arch):
    """One sharing layer in isolation: attention(Q_src, K_src, V_own), then its own projection."""
    model = build(tiny_arch, (3,))
    layer = model.decoder.layers[3]
    torch.manual_seed(1)
    s, b, hn = 12, 2, 16
    hidden = torch.randn(s, b, 64)
    q_src = torch.randn(s, b, 4, hn)
    k_src = torch.randn(s, b, 2, hn)
    out, passed_on = layer(hidden_states=hidden, attention_mask=None, context=(q_src, k_src), rotary_pos_emb=None)
    assert passed_on[0] is q_src and passed_on[1] is k_src  # passed on as is, no copy

    attn = layer.self_attention
    x = hidden.transpose(0, 1)  # [b, s, h]
    xn = ref.rms_norm(x, layer.input_layernorm.weight, 1e-5)
    v = ref.heads(xn @ attn.linear_v.weight.T, 2)
    a = ref.attention(q_src.permute(1, 2, 0, 3), k_src.permute(1, 2, 0, 3), v)
    h1 = x + a.transpose(1, 2).reshape(b, s, -1) @ attn.linear_proj.weight.T
    mlp = layer.mlp
    xn = ref.rms_norm(h1, layer.pre_mlp_layernorm.weight, 1e-5)
    gate, up = mlp.linear_fc1.weight.chunk(2)
    expected = h1 + (torch.nn.functional.silu(xn @ gate.T) * (xn @ up.T)) @ mlp.linear_fc2.weight.T
    # fp32 rounding of SDPA vs a matmul reference reaches ~1e-6 on outputs of size ~1; a wrong Q/K is O(1) off.
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=1e-5, atol=1e-5)


def test_detach_shared_stops_gradients_into_the_source(tiny_arch):
    tokens = torch.randint(0, tiny_arch.vocab_size, (1, 16))
    pos = torch.arange(16).unsqueeze(0)
    attached, detached = build(tiny_arch, (2, 3)), build(tiny_arch, (2, 3), detach=True)
    for model in (attached, detached):
        model(tokens, pos, None, labels=tokens).sum().backward()
    q_rows = slice(0, 32)  # group 0's two query heads in the fused layout
    grad_attached = attached.decoder.layers[1].self_attention.linear_qkv.weight.grad
    grad_detached = detached.decoder.layers[1].self_attention.linear_qkv.weight.grad
    assert not torch.allclose(grad_attached[q_rows], grad_detached[q_rows])
    # The forward is the same either way.
    torch.testing.assert_close(attached(tokens, pos, None, labels=tokens), detached(tokens, pos, None, labels=tokens), rtol=0, atol=0)


def test_parameter_counts(tiny_arch):
    plain, shared = build(tiny_arch), build(tiny_arch, (2, 3))
    total = lambda m: sum(p.numel() for p in m.parameters())
    trainable = lambda m: sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert total(plain) == total(shared)
    h, q_rows, k_rows = 64, 4 * 16, 2 * 16
    assert trainable(plain) - trainable(shared) == 2 * (q_rows + k_rows) * h
    # A sharing layer holds exactly the fused QKV's rows, split into the two projections.
    for i in (2, 3):
        attention = shared.decoder.layers[i].self_attention
        assert attention.linear_v.weight.shape == (k_rows, h)
        assert attention.linear_qk.weight.shape == (q_rows + k_rows, h)
        assert not attention.linear_qk.weight.requires_grad


def test_region_init_equals_plain_init(tiny_arch):
    """A model built with a region has the plain model's weights (layout/region-independent init)."""
    plain, shared = build(tiny_arch), build(tiny_arch, (1, 2, 3))
    shared_state = strip_extra_state(shared.state_dict())
    missing = shared.load_state_dict(strip_extra_state(plain.state_dict()), strict=False)
    assert not missing.missing_keys
    for key, value in strip_extra_state(shared.state_dict()).items():
        assert torch.equal(value, shared_state[key]), key
