"""SDPA core attention equals Megatron-Core's unfused DotProductAttention (the reference), for
computing and sharing layers, causal and explicit masks, MHA and GQA, forward and backward."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention  # noqa: F401  (the kernel under test)

from epas_testing import build

pytestmark = pytest.mark.usefixtures("single_process")


def _config(heads: int, groups: int, hidden: int = 64):
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import make_transformer_config

    arch = LlamaArchitecture(num_layers=2, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                             ffn_hidden_size=128, vocab_size=128, max_sequence_length=16)
    return make_transformer_config(BuildPlan.for_region(arch))


def _attentions(config, mask_type):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from epas_megatron.model.core_attention import SDPAttention

    kwargs = dict(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")
    return SDPAttention(**kwargs), DotProductAttention(**kwargs)


def _qkv(config, sq=12, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hn = config.kv_channels

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 2.0).requires_grad_(True)

    return rand(sq, b, config.num_attention_heads, hn), rand(sq, b, config.num_query_groups, hn), rand(sq, b, config.num_query_groups, hn)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_causal_sdpa_equals_unfused(heads, groups):
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(heads, groups)
    sdpa, unfused = _attentions(config, AttnMaskType.causal)
    inputs = _qkv(config)
    ours = sdpa(*inputs, None)
    grad_out = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, inputs, grad_out)
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref = unfused(*ref_inputs, None)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out)
    assert ours.shape == ref.shape == (12, 3, heads * config.kv_channels)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_explicit_mask_follows_megatron_convention():
    """True = masked out (Megatron), whatever the mask type; here a random padding pattern."""
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(4, 2)
    sdpa, unfused = _attentions(config, AttnMaskType.padding)
    q, k, v = _qkv(config, seed=3)
    mask = torch.rand(3, 1, 12, 12, generator=torch.Generator().manual_seed(4)) < 0.3
    mask[..., 0] = False  # every query sees at least one key
    torch.testing.assert_close(sdpa(q, k, v, mask), unfused(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_whole_model_with_sharing_matches_unfused_attention(tiny_arch):
    """A model with a sharing region (shared Q/K reach the same kernel) gives the same loss and
    gradients with either kernel."""
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    models = {name: build(tiny_arch, (2, 3), core_attention=name) for name in ("sdpa", "unfused")}
    losses = {}
    for name, model in models.items():
        loss = model(tokens, pos, None, labels=tokens)
        loss.sum().backward()
        losses[name] = loss
    torch.testing.assert_close(losses["sdpa"], losses["unfused"], rtol=1e-5, atol=1e-5)
    reference = dict(models["unfused"].named_parameters())
    for name, param in models["sdpa"].named_parameters():
        if param.requires_grad:
            # fp32 reassociation noise grows through the layers: compare per-tensor norms.
            error = (param.grad - reference[name].grad).norm() / reference[name].grad.norm()
            assert error < 1e-5, (name, float(error))


def test_unsupported_features_fail_with_the_knob_named():
    from megatron.core.transformer.enums import AttnMaskType

    config = _config(4, 2)
    sdpa, _ = _attentions(config, AttnMaskType.causal)
    q, k, v = _qkv(config)
    with pytest.raises(NotImplementedError, match="attention bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
