"""Random-LTD in the model against the independent plain-PyTorch LLaMA (tests/llama_reference.py),
which runs each dropping layer sequence by sequence on the kept tokens as a short sequence at
their original positions (RoPE) with an ordinary causal mask, the rest passing unchanged."""

import pytest
import torch

import llama_reference as ref
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.builder import build_model
from epas_megatron.random_ltd.keyed_draw import kept_token_indices
from epas_megatron.random_ltd.model import set_kept_tokens
from epas_megatron.random_ltd.option import RandomLTDSettings
from epas_megatron.sharing.shape import RegionShape
from epas_testing import per_token_loss, reference_weights

pytestmark = pytest.mark.usefixtures("single_process")

SEQ, BATCH = 24, 3


def build(arch, sharing=(), share="qk", ltd_layers=(0, 1, 2, 3), exclude_last=0, seed=7, recompute=None):
    from epas_megatron.model.build_plan import RecomputeSettings

    plan = BuildPlan.for_region(arch, sharing, share=share, shape=RegionShape(arch.num_layers, exclude_last),
                                recompute=recompute or RecomputeSettings(),
                                options=(RandomLTDSettings(tuple(ltd_layers), seed=seed, kernels="torch"),))
    return build_model(plan, seed=11).chunks[0]


def batch(arch):
    torch.manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (BATCH, SEQ))
    labels = torch.randint(0, arch.vocab_size, (BATCH, SEQ))
    return tokens, labels, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1), torch.tensor([5, 17, 40])


def expected_kept(sample_ids, dropping, kept, seed=7):
    """The positions each dropping layer keeps (the draw itself is tested in test_tokens.py)."""
    index = kept_token_indices(sample_ids.tolist(), dropping, SEQ, kept, seed)
    return {layer: index[i] for i, layer in enumerate(dropping)}


REGIONS = [
    ((), 0, (0, 1, 2, 3)),           # plain Random-LTD, every layer drops
    ((2, 3), 0, (0, 1, 2, 3)),       # layer 1 is the source: Q/K for all tokens, the rest for its kept ones
    ((3,), 0, (0, 1, 2, 3)),
    ((1, 2), 1, (0, 1, 2, 3)),       # source 0; layer 3 computes after the region
]


# Without sharing the share mode plays no part: that region runs once, as 'qk'.
@pytest.mark.parametrize("share, sharing, exclude_last, dropping",
                         [(share, *region) for region in REGIONS for share in ("qk", "kv") if region[0] or share == "qk"])
def test_forward_and_gradients_match_reference(tiny_arch, share, sharing, exclude_last, dropping):
    tokens, labels, positions, sample_ids = batch(tiny_arch)
    model = build(tiny_arch, sharing, share, exclude_last=exclude_last)
    set_kept_tokens([model], 10)
    ours = model(tokens, positions, None, labels=labels, sample_ids=sample_ids)
    ours.sum().backward()

    hf, w = reference_weights(model, tiny_arch, requires_grad=True)
    kept = expected_kept(sample_ids, dropping, 10)
    expected = per_token_loss(ref.forward(w, tokens, 4, 4, 2, set(sharing), share, kept=kept), labels)
    expected.sum().backward()
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # Dropping changes the result (the comparison can fail) ...
    full = per_token_loss(ref.forward(w, tokens, 4, 4, 2, set(sharing), share), labels)
    assert not torch.allclose(ours, full, rtol=1e-3, atol=1e-3)
    # ... and gradients of every weight agree, the dropping layers' MLP and output projection included.
    for layer in range(4):
        got = model.decoder.layers[layer].mlp.linear_fc2.weight.grad
        want = hf[f"model.layers.{layer}.mlp.down_proj.weight"].grad
        assert (got - want).norm() / want.norm() < 1e-5, f"layer {layer}"
        got = model.decoder.layers[layer].self_attention.linear_proj.weight.grad
        want = hf[f"model.layers.{layer}.self_attn.o_proj.weight"].grad
        assert (got - want).norm() / want.norm() < 1e-5, f"layer {layer}"
    emb = model.embedding.word_embeddings.weight.grad
    assert (emb - hf["model.embed_tokens.weight"].grad).norm() / hf["model.embed_tokens.weight"].grad.norm() < 1e-5


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recompute_replays_the_same_tokens(tiny_arch, granularity):
    from epas_megatron.model.build_plan import RecomputeSettings

    tokens, labels, positions, sample_ids = batch(tiny_arch)
    results = []
    for recompute in (RecomputeSettings(), RecomputeSettings(granularity, "uniform", 2)):
        model = build(tiny_arch, (2, 3), recompute=recompute)
        set_kept_tokens([model], 8)
        loss = model(tokens, positions, None, labels=labels, sample_ids=sample_ids)
        loss.sum().backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_no_dropping_in_eval_or_at_full_length(tiny_arch):
    tokens, labels, positions, sample_ids = batch(tiny_arch)
    model = build(tiny_arch, (3,))
    _, w = reference_weights(model, tiny_arch, requires_grad=True)
    full = per_token_loss(ref.forward(w, tokens, 4, 4, 2, {3}), labels)
    set_kept_tokens([model], SEQ)  # the ramp's end: every token kept
    torch.testing.assert_close(model(tokens, positions, None, labels=labels, sample_ids=sample_ids), full, rtol=1e-5, atol=1e-5)
    set_kept_tokens([model], 6)
    model.eval()  # evaluation sees every token (as DeepSpeed's layers: training only)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, positions, None, labels=labels, sample_ids=sample_ids), full, rtol=1e-5, atol=1e-5)
    model.train()
    with pytest.raises(RuntimeError, match="sample ids"):
        model(tokens, positions, None, labels=labels)
