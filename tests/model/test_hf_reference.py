"""The local-spec model equals Hugging Face's LlamaForCausalLM (built from a config, no download),
with either attention kernel, and region 0 with Megatron's unfused attention equals Megatron-Core's
stock GPTModel (local spec) bit for bit."""

from dataclasses import replace

import pytest
import torch

from epas_megatron.convert.hf_llama import hf_config_kwargs, hf_to_megatron, megatron_to_hf, strip_extra_state
from epas_testing import assert_same_gradient, build

pytestmark = pytest.mark.usefixtures("single_process")


def hf_model(arch, state):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**hf_config_kwargs(arch))
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state, strict=not arch.tie_embeddings)
    return model


@pytest.mark.parametrize("core_attention", ["sdpa", "unfused"])
def test_local_model_equals_hugging_face_llama(tiny_arch, core_attention):
    model = build(tiny_arch, core_attention=core_attention).eval()
    hf = hf_model(tiny_arch, megatron_to_hf(strip_extra_state(model.state_dict()), tiny_arch))
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = model(tokens, pos, None)  # [b, s, v]
        theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_equal_hugging_face_llama_with_tied_weights(tiny_arch):
    """``--no-untie-embeddings-and-output-weights``: one matrix is the embedding and the LM head.
    Logits and the gradient of that matrix (both uses' contributions) equal transformers'
    LlamaForCausalLM with ``tie_word_embeddings=True``; the model has no head weight of its own."""
    arch = replace(tiny_arch, tie_embeddings=True)
    model = build(arch)
    untied = build(tiny_arch)
    params = dict(model.named_parameters())
    assert "output_layer.weight" not in params
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in params.values()) == arch.vocab_size * arch.hidden_size
    hf = hf_model(arch, megatron_to_hf(strip_extra_state(model.state_dict()), arch)).train()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = torch.randint(0, arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    ours = model(tokens, torch.arange(32).unsqueeze(0).expand(2, -1), None)
    theirs = hf(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    (ours.square().mean()).backward()
    (theirs.square().mean()).backward()
    grad = params["embedding.word_embeddings.weight"].grad
    assert_same_gradient(grad, hf.model.embed_tokens.weight.grad)
    # Both uses' contributions are in it: the rows of tokens absent from the input get the head's
    # gradient only, the others the embedding's too.
    absent = torch.ones(arch.vocab_size, dtype=torch.bool)
    absent[tokens.unique()] = False
    assert grad[absent].abs().sum() > 0 and absent.sum() < arch.vocab_size


def test_hf_import_then_export_round_trips_with_a_sharing_region(tiny_arch):
    """Export a model trained with a region, import it into any region: same weights, and the
    region-0 import runs like the exported Hugging Face model."""
    trained = build(tiny_arch, (2, 3), seed=5)
    hf_state = megatron_to_hf(strip_extra_state(trained.state_dict()), tiny_arch)
    back = hf_to_megatron(hf_state, tiny_arch)
    again = build(tiny_arch, (2, 3), seed=99)
    again.load_state_dict(back, strict=False)
    for key, value in strip_extra_state(trained.state_dict()).items():
        assert torch.equal(value, again.state_dict()[key]), key
    plain = build(tiny_arch, (), seed=99).eval()
    plain.load_state_dict(back, strict=False)
    tokens = torch.randint(0, tiny_arch.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens, torch.arange(16).unsqueeze(0), None), hf_model(tiny_arch, hf_state)(tokens).logits,
                                   rtol=1e-5, atol=1e-5)


def test_region_zero_is_bit_identical_to_megatron_gpt_model(tiny_arch):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import make_transformer_config

    ours = build(tiny_arch, core_attention="unfused")
    stock = GPTModel(make_transformer_config(BuildPlan.for_region(tiny_arch)), get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=tiny_arch.vocab_size, max_sequence_length=tiny_arch.max_sequence_length,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    assert stock.load_state_dict(ours.state_dict(), strict=True)
    tokens = torch.randint(0, tiny_arch.vocab_size, (2, 32))
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    loss_ours, loss_stock = ours(tokens, pos, None, labels=tokens), stock(tokens, pos, None, labels=tokens)
    assert torch.equal(loss_ours, loss_stock)
    loss_ours.sum().backward()
    loss_stock.sum().backward()
    grads = dict(stock.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param.grad, grads[name].grad), name
