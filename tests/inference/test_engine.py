"""The decode engine against full forward passes of the same model (no cache), per region and
share mode; probability reuse against the Q/K path; the cache's size against its formula."""

import pytest
import torch

from epas_testing import build
from epas_megatron.inference.engine import DecodeEngine
from epas_megatron.inference.kv_cache import kv_bytes_per_token

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LENGTHS = (5, 2, 7)  # one left-padded batch
NEW_TOKENS = 6


def prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def cached_greedy(engine, batch_prompts, new_tokens=NEW_TOKENS, chunk=None):
    """Greedy tokens and each step's logits from the engine (left-padded batch, chunked prefill)."""
    longest = max(map(len, batch_prompts))
    cache = engine.new_cache(len(batch_prompts), longest + new_tokens)
    tokens = torch.zeros(len(batch_prompts), longest, dtype=torch.long)
    for row, ids in enumerate(batch_prompts):
        tokens[row, longest - len(ids):] = torch.tensor(ids)
        cache.pad[row] = longest - len(ids)
    chunk = chunk or longest
    for start in range(0, longest, chunk):
        logits = engine.forward(tokens[:, start:start + chunk], cache)
    steps, chosen = [], []
    for step in range(new_tokens):
        steps.append(logits[:, -1])
        chosen.append(logits[:, -1].argmax(-1))
        if step < new_tokens - 1:
            logits = engine.forward(chosen[-1][:, None], cache)
    return torch.stack(chosen, 1).tolist(), torch.stack(steps, 1), cache


def full_forward_greedy(model, ids, new_tokens=NEW_TOKENS):
    """The reference: argmax of a full forward over the whole sequence, every step, one prompt."""
    ids, logits = list(ids), []
    for _ in range(new_tokens):
        tokens = torch.tensor([ids])
        with torch.no_grad():
            last = model(tokens, torch.arange(len(ids))[None])[0, -1].float()
        logits.append(last)
        ids.append(int(last.argmax()))
    return ids[-new_tokens:], torch.stack(logits)


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("region", [0, 1, 3])  # 3 = every layer but the first shares
def test_cached_greedy_equals_full_forward_argmax(tiny_arch, share, region):
    sharing = tuple(range(tiny_arch.num_layers - region, tiny_arch.num_layers))
    model = build(tiny_arch, sharing, share=share).eval()
    batch = prompts(tiny_arch.vocab_size)
    attention = "reuse" if share == "qk" else "qk"
    tokens, logits, _ = cached_greedy(DecodeEngine(model, attention), batch, chunk=3)
    for row, ids in enumerate(batch):
        expected_tokens, expected_logits = full_forward_greedy(model, ids)
        assert tokens[row] == expected_tokens, f"row {row}"
        torch.testing.assert_close(logits[row], expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("region", [1, 3])
def test_probability_reuse_gives_the_qk_paths_logits(tiny_arch, region):
    sharing = tuple(range(tiny_arch.num_layers - region, tiny_arch.num_layers))
    model = build(tiny_arch, sharing, share="qk").eval()
    batch = prompts(tiny_arch.vocab_size, seed=1)
    qk_tokens, qk_logits, _ = cached_greedy(DecodeEngine(model, "qk"), batch)
    reuse_tokens, reuse_logits, _ = cached_greedy(DecodeEngine(model, "reuse"), batch)
    batched_tokens, batched_logits, _ = cached_greedy(DecodeEngine(model, "reuse", region_kernel="torch"), batch)
    assert reuse_tokens == qk_tokens == batched_tokens
    # Same probabilities, same products: identical in fp32 up to summation order.
    torch.testing.assert_close(reuse_logits, qk_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(batched_logits, qk_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("share,region", [("qk", 0), ("qk", 2), ("kv", 2)])
def test_cache_holds_what_each_layer_owns_and_is_written_in_place(tiny_arch, share, region):
    sharing = tuple(range(tiny_arch.num_layers - region, tiny_arch.num_layers))
    model = build(tiny_arch, sharing, share=share).eval()
    engine = DecodeEngine(model, "reuse" if share == "qk" else "qk")
    batch, length = 3, 16
    cache = engine.new_cache(batch, length)
    # By hand: computing layers K and V, 'qk' sharing layers V only, 'kv' sharing layers nothing;
    # each tensor g=2 groups x hn=16 x 4 bytes per token.
    tensors = 2 * (tiny_arch.num_layers - region) + (region if share == "qk" else 0)
    assert cache.nbytes == tensors * 2 * 16 * 4 * batch * length
    assert kv_bytes_per_token(engine.modes, share, 2, 16, 4) == tensors * 2 * 16 * 4
    _, _, cache = cached_greedy(engine, prompts(tiny_arch.vocab_size)[:batch], new_tokens=4)
    # Decode steps write into the same buffers (no re-allocation, no torch.cat).
    before = [t.data_ptr() for t in (cache.computing_keys, cache.computing_values, cache.sharing_values)]
    engine.forward(torch.zeros(batch, 1, dtype=torch.long), cache)
    after = [t.data_ptr() for t in (cache.computing_keys, cache.computing_values, cache.sharing_values)]
    assert before == after and cache.length == max(PROMPT_LENGTHS) + 4


def test_engine_refuses_reuse_for_kv_models(tiny_arch):
    from epas_megatron.errors import ConfigError

    model = build(tiny_arch, (3,), share="kv").eval()
    with pytest.raises(ConfigError, match="reuse needs a 'qk' sharing model"):
        DecodeEngine(model, "reuse")


@pytest.mark.parametrize("share, attention, kernel", [("qk", "qk", None), ("qk", "reuse", "torch"), ("kv", "qk", None)])
@pytest.mark.parametrize("sharing, exclude_last", [((1, 2), 1), ((2,), 1)])
def test_region_before_computing_layers_decodes_like_full_forwards(tiny_arch, sharing, exclude_last, share, attention, kernel):
    """--epas-exclude-last: the computing layer after the region caches its own K and V and
    attends over them; cached decoding equals full forward passes without a cache."""
    model = build(tiny_arch, sharing, share=share, exclude_last=exclude_last).eval()
    engine = DecodeEngine(model, attention, region_kernel=kernel)
    assert engine.modes[-1] == "compute" and engine.source == sharing[0] - 1
    batch = prompts(tiny_arch.vocab_size, seed=2)
    tokens, logits, cache = cached_greedy(engine, batch, chunk=3)
    for row, ids in enumerate(batch):
        expected_tokens, expected_logits = full_forward_greedy(model, ids)
        assert tokens[row] == expected_tokens, f"row {row}"
        torch.testing.assert_close(logits[row], expected_logits, rtol=1e-4, atol=1e-4)
    # K and V for every computing layer (the tail included), V for each 'qk' sharing layer.
    computing = tiny_arch.num_layers - len(sharing)
    assert cache.computing_keys.size(0) == computing
    assert cache.sharing_values.size(0) == (len(sharing) if share == "qk" else 0)
