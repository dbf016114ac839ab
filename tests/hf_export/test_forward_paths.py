"""Sharing in every forward of the ``transformers`` EPAS model: without a cache, with an
``EpasCache`` (token by token), under left padding, with gradient checkpointing (values and
gradients) and with probability reuse -- each against the plain-PyTorch reference
(``llama_reference``, its own autograd for gradients); the cache's bytes measured from its
tensors against the formula and against transformers' ``DynamicCache`` of plain LLaMA.

Share 'qk' runs on the export of the trained fixture checkpoint; share 'kv' on a random model of
the same shape written with the shipped classes (the framework comparison of 'kv' is at the end,
through ``hf-import``)."""

import pytest
import torch

from epas_megatron.convert.cli import main as convert
from llama_reference import forward

LAYERS, HEADS, GROUPS, HN = 4, 4, 2, 16  # the tiny preset
SHARING = (2, 3)


def reference_weights(model) -> dict:
    """``llama_reference`` weights from the model's parameters themselves (frozen rows under their
    q/k/v names), so reference gradients land on the same tensors."""
    state = dict(model.named_parameters())
    layers = []
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        proj = lambda x: state.get(f"{p}self_attn.{x}_proj.weight", state.get(f"{p}self_attn.frozen_{x}_proj.weight"))
        layers.append({"q": proj("q"), "k": proj("k"), "v": proj("v"), "o": proj("o"), "gate": state[p + "mlp.gate_proj.weight"],
                       "up": state[p + "mlp.up_proj.weight"], "down": state[p + "mlp.down_proj.weight"],
                       "input_norm": state[p + "input_layernorm.weight"], "mlp_norm": state[p + "post_attention_layernorm.weight"]})
    return {"embed": state["model.embed_tokens.weight"], "final_norm": state["model.norm.weight"], "head": state["lm_head.weight"],
            "layers": layers}


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory):
    from epas_megatron.hf import EpasLlamaConfig, EpasLlamaForCausalLM

    config = EpasLlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64, rms_norm_eps=1e-5,
                             initializer_range=0.1, epas_share="kv", epas_sharing_layers=list(SHARING))
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("kv") / "epas-kv"
    EpasLlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def models(exported, kv_dir):
    """``models(share, region, **config)``: a fresh fp32 model in eval mode."""
    from epas_megatron.hf import EpasLlamaForCausalLM

    def build(share, region=2, **config):
        path = exported if share == "qk" else kv_dir
        model = EpasLlamaForCausalLM.from_pretrained(path, dtype=torch.float32, epas_region=region, **config)
        return model.eval()

    return build


def reference(model, tokens):
    return forward(reference_weights(model), tokens, LAYERS, HEADS, GROUPS, sharing=model.config.epas_active_layers,
                   share=model.config.epas_share)


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("region", [0, 1, 2])
def test_with_and_without_a_cache_equal_the_reference(share, region, models, tokens):
    from epas_megatron.hf import EpasCache

    model = models(share, region)
    with torch.no_grad():
        expected = reference(model, tokens)
        torch.testing.assert_close(model(tokens, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
        cache = EpasCache(model.config)
        steps = [model(tokens[:, :10], cache=cache, use_cache=True).logits]  # prefill, then one token at a time
        steps += [model(tokens[:, t:t + 1], cache=cache, use_cache=True).logits for t in range(10, tokens.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share", ["qk", "kv"])
def test_left_padding_starts_every_row_at_position_0(share, models, tokens):
    """A left-padded batch (attention mask, positions from it) gives each row the logits of the row alone."""
    from epas_megatron.hf import EpasCache

    model = models(share)
    lengths = (24, 15)
    padded = torch.zeros(2, 24, dtype=torch.long)
    mask = torch.zeros(2, 24, dtype=torch.long)
    for row, n in enumerate(lengths):
        padded[row, 24 - n:], mask[row, 24 - n:] = tokens[row, :n], 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        whole = model(padded, attention_mask=mask, position_ids=positions).logits
        cache = EpasCache(model.config)
        steps = [model(padded[:, :20], attention_mask=mask[:, :20], position_ids=positions[:, :20], cache=cache).logits]
        for t in range(20, 24):
            steps.append(model(padded[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                               cache=cache).logits)
        for row, n in enumerate(lengths):
            alone = reference(model, tokens[row:row + 1, :n])[0]
            torch.testing.assert_close(whole[row, 24 - n:], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.cat(steps, dim=1)[row, 24 - n:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_reference_gradients(share, reentrant, models, tokens):
    model = models(share).train()
    labels = tokens[:, 1:]

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))

    reference_loss = loss_of(reference(model, tokens))
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = torch.autograd.grad(reference_loss, trainable)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    loss = loss_of(model(tokens, use_cache=False).logits)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    for (name, parameter), grad in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], expected):
        torch.testing.assert_close(parameter.grad, grad, rtol=1e-4, atol=1e-6, msg=name)
    # The hand-off carries gradient: the source's Q and K rows get some from the sharing layers.
    source = model.model.layers[SHARING[0] - 1].self_attn
    assert (source.q_proj if share == "qk" else source.v_proj).weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if ".frozen_" in n)


def test_probability_reuse_equals_recomputation(models, tokens):
    from epas_megatron.hf import EpasCache

    recompute, reuse = models("qk"), models("qk", epas_reuse_probs=True)
    assert reuse.config.epas_reuse_probs and not recompute.config.epas_reuse_probs
    with torch.no_grad():
        torch.testing.assert_close(reuse(tokens).logits, recompute(tokens).logits, rtol=1e-5, atol=1e-5)
        caches = EpasCache(reuse.config), EpasCache(recompute.config)
        for chunk in (tokens[:, :12], tokens[:, 12:13], tokens[:, 13:14]):
            a, b = (m(chunk, cache=c, use_cache=True).logits for m, c in zip((reuse, recompute), caches))
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def measured_bytes(cache) -> int:
    """Bytes of every tensor a cache object holds, read from its layers."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                                  getattr(layer, "values", None)) if t is not None)


@pytest.mark.parametrize("share", ["qk", "kv"])
def test_the_cache_holds_what_each_layer_owns(share, models, tokens):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from epas_megatron.hf import EpasCache, cache_bytes_per_token

    model = models(share)
    b, s = tokens.shape
    with torch.no_grad():
        cache = model(tokens, use_cache=True).cache
        assert isinstance(cache, EpasCache)
        llama = LlamaForCausalLM(LlamaConfig(**{k: getattr(model.config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}))
        plain = llama(tokens, use_cache=True).cache
    assert isinstance(plain, DynamicCache)
    per_part = GROUPS * HN * 4  # one K (or V) of one token, fp32
    assert measured_bytes(plain) == b * s * LAYERS * 2 * per_part
    saved = len(SHARING) * (1 if share == "qk" else 2) * per_part  # the K (and V) the sharing layers never store
    assert measured_bytes(cache) == measured_bytes(plain) - b * s * saved
    assert measured_bytes(cache) == b * s * cache_bytes_per_token(model.config, torch.float32) == cache.cached_bytes()
    for i in SHARING:
        assert cache.layers[i].keys is None and (cache.layers[i].values is None) == (share == "kv")


def test_a_cache_that_would_store_k_for_sharing_layers_is_refused(models, tokens):
    from transformers import DynamicCache

    with pytest.raises(TypeError, match="needs an EpasCache"):
        models("qk")(tokens, cache=DynamicCache(), use_cache=True)


@pytest.fixture(scope="module")
def kv_imported(kv_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("kv_import") / "ckpt"
    assert convert(["hf-import", "--hf-dir", str(kv_dir), "--output", str(path)]) == 0
    return path


@pytest.mark.parametrize("region", [0, 1, 2])
def test_kv_share_equals_the_framework(region, kv_imported, models, tokens, world, framework_model):
    """'kv' against this framework's CLA-like layers: the random kv model imported, run at each region."""
    ours = framework_model(kv_imported, region).eval()
    model = models("kv", region)
    with torch.no_grad():
        expected = ours(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :512]
        torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)
