"""The decode engine against full forward passes of the same model (no cache), per region and
share mode -- eager steps and the fixed-shape step a CUDA graph replays; probability reuse
against the Q/K path; the cache's size against its formula; bf16 against fp32; the attention
helpers by hand."""

from dataclasses import replace

import pytest
import torch

from epas_megatron.errors import ConfigError
from epas_megatron.inference import attention as attn_ops
from epas_megatron.inference.decode_step import StaticDecodeStep, resolve_decode_step
from epas_megatron.inference.engine import DecodeEngine
from epas_megatron.inference.generator import Generator
from epas_megatron.inference.kv_cache import kv_bytes_per_token
from epas_testing import build, reference_weights

pytestmark = pytest.mark.usefixtures("single_process")

PROMPT_LENGTHS = (5, 2, 7)  # one left-padded batch
NEW_TOKENS = 6


def prompts(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def cached_greedy(engine, batch_prompts, new_tokens=NEW_TOKENS, chunk=None, static=False, spare=0, fill=None):
    """Greedy tokens and each step's logits from the engine (left-padded batch, chunked prefill).
    ``static``: decode steps run the fixed-shape step (what a CUDA graph replays) instead of
    eager forwards; ``spare`` extra cache slots (a fixed-shape step reads them, masked); ``fill``:
    a value for every cache slot before prefill (garbage that must never be attended to)."""
    longest = max(map(len, batch_prompts))
    cache = engine.new_cache(len(batch_prompts), longest + new_tokens + spare)
    if fill is not None:
        for buffer in (cache.computing_keys, cache.computing_values, cache.sharing_values):
            buffer.fill_(fill)
    tokens = torch.zeros(len(batch_prompts), longest, dtype=torch.long)
    for row, ids in enumerate(batch_prompts):
        tokens[row, longest - len(ids):] = torch.tensor(ids)
        cache.pad[row] = longest - len(ids)
    chunk = chunk or longest
    for start in range(0, longest, chunk):
        logits = engine.forward(tokens[:, start:start + chunk], cache)
    step_fn = StaticDecodeStep(engine, cache, graph=False) if static else (lambda t: engine.forward(t, cache))
    steps, chosen = [], []
    for step in range(new_tokens):
        steps.append(logits[:, -1].clone())  # a static step's logits live in its buffer
        chosen.append(logits[:, -1].argmax(-1))
        if step < new_tokens - 1:
            logits = step_fn(chosen[-1][:, None])
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


def assert_decodes_like_full_forwards(model, engine, batch):
    """Cached greedy decoding (prefill in chunks of 3) gives every row's tokens and logits of full
    forward passes without a cache; returns the cache."""
    tokens, logits, cache = cached_greedy(engine, batch, chunk=3)
    for row, ids in enumerate(batch):
        expected_tokens, expected_logits = full_forward_greedy(model, ids)
        assert tokens[row] == expected_tokens, f"row {row}"
        torch.testing.assert_close(logits[row], expected_logits, rtol=1e-4, atol=1e-4)
    return cache


@pytest.mark.parametrize("share, attention, kernel", [("qk", "qk", None), ("qk", "reuse", "torch"), ("kv", "qk", None)])
def test_several_blocks_decode_like_full_forwards(tiny_arch, share, attention, kernel):
    """--epas-blocks 2 on 4 layers: layers 1 and 3 share, each with its own source (0 and 2); each
    sharing layer attends over its own source's cached K (and V for 'kv'), and the reused
    probabilities are its own block's; cached decoding equals full forward passes."""
    model = build(tiny_arch, (1, 3), share=share, blocks=2).eval()
    engine = DecodeEngine(model, attention, region_kernel=kernel)
    assert engine.modes == ("source", "share", "source", "share")
    batch = prompts(tiny_arch.vocab_size, seed=3)
    cache = assert_decodes_like_full_forwards(model, engine, batch)
    assert cache.computing_keys.size(0) == 2 and cache.sharing_values.size(0) == (2 if share == "qk" else 0)


@pytest.mark.parametrize("share, attention, kernel", [("qk", "qk", None), ("qk", "reuse", "torch"), ("kv", "qk", None)])
@pytest.mark.parametrize("sharing, exclude_last", [((1, 2), 1), ((2,), 1)])
def test_region_before_computing_layers_decodes_like_full_forwards(tiny_arch, sharing, exclude_last, share, attention, kernel):
    """--epas-exclude-last: the computing layer after the region caches its own K and V and
    attends over them; cached decoding equals full forward passes without a cache."""
    model = build(tiny_arch, sharing, share=share, exclude_last=exclude_last).eval()
    engine = DecodeEngine(model, attention, region_kernel=kernel)
    assert engine.modes[-1] == "compute" and engine.source == sharing[0] - 1
    batch = prompts(tiny_arch.vocab_size, seed=2)
    cache = assert_decodes_like_full_forwards(model, engine, batch)
    # K and V for every computing layer (the tail included), V for each 'qk' sharing layer.
    computing = tiny_arch.num_layers - len(sharing)
    assert cache.computing_keys.size(0) == computing
    assert cache.sharing_values.size(0) == (len(sharing) if share == "qk" else 0)


@pytest.mark.parametrize("share, attention, kernel", [("qk", "reuse", None), ("qk", "reuse", "torch"), ("qk", "qk", None),
                                                      ("kv", "qk", None)])
def test_fixed_shape_step_equals_full_forwards(tiny_arch, share, attention, kernel):
    """The step a CUDA graph replays (write slot as a tensor, attention over every slot of the
    cache, later ones masked) gives the full forwards' tokens and logits -- with garbage in the
    slots it must not read, and spare slots after the last token."""
    model = build(tiny_arch, (2, 3), share=share).eval()
    engine = DecodeEngine(model, attention, region_kernel=kernel)
    batch = prompts(tiny_arch.vocab_size, seed=3)
    tokens, logits, cache = cached_greedy(engine, batch, chunk=4, static=True, spare=3, fill=50.0)
    assert cache.length == max(PROMPT_LENGTHS) + NEW_TOKENS - 1
    for row, ids in enumerate(batch):
        expected_tokens, expected_logits = full_forward_greedy(model, ids)
        assert tokens[row] == expected_tokens, f"row {row}"
        torch.testing.assert_close(logits[row], expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed_shape"])
def test_tied_embeddings_decode_like_the_reference(tiny_arch, static):
    """An LM head tied to the embedding (``--no-untie-embeddings-and-output-weights``, as
    Llama-3.2-1B ties them) owns no weight; the engine must hand it the embedding's. Eager and
    fixed-shape steps give the plain-PyTorch reference's logits with the embedding as the head."""
    import llama_reference as ref

    arch = replace(tiny_arch, tie_embeddings=True)
    model = build(arch, (2, 3)).eval()
    assert "output_layer.weight" not in dict(model.named_parameters())
    _, weights = reference_weights(model, arch)
    weights["head"] = weights["embed"]  # the reference's own tie, not the mapping's
    batch = prompts(arch.vocab_size, seed=5)
    tokens, logits, _ = cached_greedy(DecodeEngine(model, "reuse"), batch, chunk=4, static=static)
    for row, ids in enumerate(batch):
        sequence = torch.tensor([ids + tokens[row][:-1]])
        expected = ref.forward(weights, sequence, arch.num_layers, arch.num_attention_heads, arch.num_query_groups,
                               sharing=(2, 3))[0, len(ids) - 1:]
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
        assert tokens[row] == expected.argmax(-1).tolist(), f"row {row}"


def test_fixed_shape_step_keeps_its_buffers_and_refuses_a_full_cache(tiny_arch):
    """What a graph replay relies on: the same input, slot and cache storage every step, the slot
    a device value equal to the position written, ``cache.length`` advanced on the host."""
    model = build(tiny_arch, (2, 3)).eval()
    engine = DecodeEngine(model, "reuse")
    cache = engine.new_cache(2, 6)
    engine.forward(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache)
    step = StaticDecodeStep(engine, cache, graph=False)
    assert not step.captured
    storage = [t.data_ptr() for t in (step.tokens, step.slot, cache.computing_keys, cache.computing_values, cache.sharing_values)]
    for position in (3, 4, 5):
        step(torch.tensor([[1], [2]]))
        assert int(step.slot) == position and cache.length == position + 1
        # the token's V went into its slot of the sharing layers' cache, nothing after it
        assert cache.sharing_values[:, :, :, position].abs().sum() > 0
        if position < 5:
            assert cache.sharing_values[:, :, :, position + 1:].abs().sum() == 0
    assert storage == [t.data_ptr() for t in (step.tokens, step.slot, cache.computing_keys, cache.computing_values,
                                              cache.sharing_values)]
    with pytest.raises(ConfigError, match="exceeds the cache's 6"):
        step(torch.tensor([[1], [2]]))
    with pytest.raises(ConfigError, match="the cache is full"):
        StaticDecodeStep(engine, cache, graph=False)


def test_decode_step_choices():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only the device type is read
    assert resolve_decode_step("auto", cpu) == "eager" and resolve_decode_step("static", cpu) == "static"
    assert resolve_decode_step("auto", cuda) == "cuda-graph" and resolve_decode_step("auto", cuda, decode_steps=3) == "eager"
    with pytest.raises(ConfigError, match="cuda-graph needs a CUDA device"):
        resolve_decode_step("cuda-graph", cpu)
    with pytest.raises(ConfigError, match="--decode-step 'graph'"):
        resolve_decode_step("graph", cpu)


@pytest.mark.parametrize("decode_step", ["eager", "static"])
def test_generator_decode_steps_give_the_full_forwards_tokens(tiny_arch, decode_step):
    model = build(tiny_arch, (2, 3)).eval()
    batch = prompts(tiny_arch.vocab_size, seed=4)
    results = Generator(model, decode_step=decode_step).generate(batch, max_new_tokens=NEW_TOKENS, eos_id=-1)
    for row, ids in enumerate(batch):
        assert results[row].tokens == full_forward_greedy(model, ids)[0], f"row {row}"
    with pytest.raises(ConfigError, match="cuda-graph needs a CUDA device"):
        Generator(model, decode_step="cuda-graph")


def test_bf16_engine_follows_fp32_as_closely_as_a_bf16_full_forward(tiny_arch):
    """The engine's bf16 arithmetic (K read in bf16, fp32 scores and softmax, P in bf16) on the
    weights of a bf16 model, against fp32 arithmetic on the same weights: its logits' error is
    within twice the error of Megatron's own bf16 full forward and within 5 % of the largest
    logit (measured: both errors about 1.7 %, the large init making attention sharp)."""
    sharing = (2, 3)
    bf16 = build(tiny_arch, sharing, precision="bf16").eval()
    fp32 = build(tiny_arch, sharing).eval()
    with torch.no_grad():
        for (name16, p16), (name32, p32) in zip(bf16.module.named_parameters(), fp32.named_parameters()):
            assert name16 == name32
            p32.copy_(p16.float())  # the same (bf16-rounded) weights
    ids = torch.randint(0, tiny_arch.vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(9).expand(3, 9)
    with torch.no_grad():
        full16, full32 = bf16(ids, positions).float(), fp32(ids, positions)
    scale = full32.abs().max()
    full_error = (full16 - full32).abs().max()
    for attention, kernel in (("reuse", None), ("reuse", "torch"), ("qk", None)):
        engine = DecodeEngine(bf16, attention, region_kernel=kernel)
        assert engine.dtype == torch.bfloat16
        cache = engine.new_cache(3, 10)
        logits = [engine.forward(ids[:, :5], cache, last_only=False)]
        step = StaticDecodeStep(engine, cache, graph=False)
        for column in range(5, 9):  # decode the rest, half eager, half fixed-shape
            token = ids[:, column:column + 1]
            logits.append(engine.forward(token, cache) if column < 7 else step(token).clone())
        error = (torch.cat(logits, 1) - full32).abs().max()
        assert error <= 2 * full_error and error <= 0.05 * scale, (attention, kernel, error, full_error, scale)
        assert cache.computing_keys.dtype == cache.sharing_values.dtype == torch.bfloat16


def test_blocked_slots_and_probabilities_by_hand():
    # Two rows, the second with 2 padding slots; one new token at slot 3 of 5 visible slots.
    blocked = attn_ops.blocked_slots(torch.tensor([0, 2]), torch.tensor([3]), 5)
    assert blocked.shape == (2, 1, 1, 5)
    assert blocked[:, 0, 0].tolist() == [[False, False, False, False, True], [True, True, False, False, True]]
    # A padding token (slot 0 of row 1) sees only itself.
    blocked = attn_ops.blocked_slots(torch.tensor([0, 2]), torch.tensor([0, 1]), 2)
    assert blocked[1, 0].tolist() == [[False, True], [True, False]]
    # probabilities: b 2, g 2, q 3 heads per group, n 1; against softmax written out.
    gen = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 2, 3, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    blocked = attn_ops.blocked_slots(torch.tensor([0, 2]), torch.tensor([3]), 5)
    probs = attn_ops.probabilities(query, keys, blocked, 0.5)
    scores = torch.einsum("bgmd,bgtd->bgmt", query, keys) * 0.5
    allowed = ~blocked[:, :, 0, :].unsqueeze(2)  # [b, 1, 1, T]
    weights = torch.where(allowed, scores.exp(), torch.zeros(()))
    expected = weights / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    # bf16 operands: fp32 scores and softmax, P returned in bf16 (or the dtype asked for)
    probs16 = attn_ops.probabilities(query.bfloat16(), keys.bfloat16(), blocked, 0.5)
    assert probs16.dtype == torch.bfloat16
    exact16 = attn_ops.probabilities(query.bfloat16().float(), keys.bfloat16().float(), blocked, 0.5)
    torch.testing.assert_close(probs16.float(), exact16, rtol=0, atol=4e-3)  # one bf16 rounding of P
    # asked for in fp32: the scores were never rounded to bf16
    probs16_fp32 = attn_ops.probabilities(query.bfloat16(), keys.bfloat16(), blocked, 0.5, dtype=torch.float32)
    torch.testing.assert_close(probs16_fp32, exact16, rtol=1e-6, atol=1e-7)
