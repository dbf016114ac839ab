"""Decode steps of a Mixture-of-Channels model that read only the kept rows of ``W_down``
(inference/moc_decode.py) against a plain-PyTorch masked SwiGLU (mask from a descending sort of
the gate pre-activation, fp64) and against the MLP's own dense-masked forward; the engine's
greedy tokens against full forwards of the model (no cache); on planted ties at the Top-K boundary
(tests/moc_reference.py) the decode reads exactly the channels of the reference rule (the lower
index wins a tie), as the masked forward keeps them; the bytes by hand; refusals."""


import pytest
import torch
import torch.nn.functional as F

from epas_megatron.errors import ConfigError
from epas_megatron.inference.decode_step import StaticDecodeStep
from epas_megatron.inference.engine import DecodeEngine
from epas_megatron.inference.moc_decode import MoCRowReader, down_bytes_per_step
from epas_megatron.model.moc import MoCMLP
from epas_megatron.model.moc_sizes import MoCSettings
from epas_testing import build
from moc_reference import (
    assert_close_to_reference,
    boundary_ties,
    gate_groups,
    higher_index_channels,
    masked_swiglu,
    planted_inputs,
    planted_weights,
    reference_channels,
)

pytestmark = pytest.mark.usefixtures("single_process")

TOPK, GROUPS = 0.25, 4  # tiny: ffn 176 -> 4 groups of 44 channels, 11 kept per token and group
KEPT = 11


MOC = (MoCSettings(TOPK, GROUPS),)  # the build option: Mixture-of-Channels MLPs


@pytest.fixture(scope="module")
def moc_arch(tiny_arch):
    return tiny_arch


def build_moc(arch, *args, **kwargs):
    """A tiny model chunk with Mixture-of-Channels MLPs (``build``'s arguments)."""
    return build(arch, *args, options=MOC, **kwargs)


def masked_reference(x, fc1, fc2):
    """Plain PyTorch in fp64: G, U = x W1^T; the mask keeps the KEPT largest G of each group (a
    descending sort); (SiLU(G) * U * M) W2^T."""
    x, fc1, fc2 = x.double(), fc1.double(), fc2.double()
    gate, up = torch.chunk(x @ fc1.t(), 2, dim=-1)
    shape = (*gate.shape[:-1], GROUPS, gate.shape[-1] // GROUPS)
    order = gate.reshape(shape).sort(dim=-1, descending=True).indices[..., :KEPT]
    mask = torch.zeros(shape, dtype=gate.dtype).scatter_(-1, order, 1.0).reshape(gate.shape)
    return (F.silu(gate) * up * mask) @ fc2.t()


def test_the_row_read_equals_a_masked_swiglu_and_reads_only_the_kept_rows(moc_arch):
    model = build_moc(moc_arch).eval()
    mlp = model.decoder.layers[1].mlp
    assert isinstance(mlp, MoCMLP) and mlp.kept == KEPT
    reader = MoCRowReader(mlp)
    x = torch.randn(1, 3, moc_arch.hidden_size, generator=torch.Generator().manual_seed(0))  # one token, 3 rows
    with torch.no_grad():
        sparse, masked = reader(x), mlp(x)[0]
        reference = masked_reference(x, mlp.linear_fc1.weight, mlp.linear_fc2.weight)
    torch.testing.assert_close(sparse.double(), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse, masked, rtol=1e-5, atol=1e-6)
    # Rows no token kept are never read: NaN there changes nothing (the dense GEMM would be NaN).
    with torch.no_grad():
        gate = mlp.linear_fc1(x)[0].chunk(2, dim=-1)[0].reshape(3, GROUPS, -1)
        kept = gate.topk(KEPT, dim=-1).indices + torch.arange(0, moc_arch.ffn_hidden_size, 44)[:, None]
        unread = torch.ones(moc_arch.ffn_hidden_size, dtype=torch.bool)
        unread[kept.flatten()] = False
        assert unread.sum() >= moc_arch.ffn_hidden_size - 3 * GROUPS * KEPT
        reader.rows[unread] = float("nan")
        torch.testing.assert_close(reader(x), sparse, rtol=0, atol=0)


def test_bf16_row_read_is_close_to_the_dense_masked_mlp(moc_arch):
    from epas_megatron.runtime.wrapping import unwrap_model

    model = unwrap_model(build_moc(moc_arch, precision="bf16")).eval()
    x = torch.randn(1, 4, moc_arch.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    for layer in model.decoder.layers:
        with torch.no_grad():
            sparse, masked = MoCRowReader(layer.mlp)(x), layer.mlp(x)[0]
        assert sparse.dtype == torch.bfloat16
        # same channels (the same topk of the same bf16 G); only the summation differs
        torch.testing.assert_close(sparse.float(), masked.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_planted_ties_the_row_read_keeps_the_reference_channels(moc_arch, precision):
    """Exact small-integer gate values (ties at the boundary in most groups; token 0 ties three
    channels for the last two places): every row the reference rule does not keep is NaN, so a
    read of any other channel would show; the result equals the masked forward and the masked
    SwiGLU of the reference's mask; the control mask (ties to the higher index) gives another."""
    from epas_megatron.runtime.wrapping import unwrap_model

    mlp = unwrap_model(build_moc(moc_arch, precision=precision)).eval().decoder.layers[0].mlp
    dtype = mlp.linear_fc1.weight.dtype
    fc1, fc2 = planted_weights(moc_arch.hidden_size, moc_arch.ffn_hidden_size, GROUPS, KEPT)
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(fc1)
        mlp.linear_fc2.weight.copy_(fc2)
    fc1, fc2 = mlp.linear_fc1.weight.detach(), mlp.linear_fc2.weight.detach()  # as rounded to the model's dtype
    x = planted_inputs((1, 6), moc_arch.hidden_size)  # one decode step of 6 sequences, [1, 6, h]
    gate = gate_groups(x, fc1, GROUPS)  # [1, 6, GROUPS, 44]
    assert boundary_ties(gate, KEPT) > 0.3
    reader = MoCRowReader(mlp)
    kept = (reference_channels(gate, KEPT) + torch.arange(0, moc_arch.ffn_hidden_size, 44)[:, None]).flatten()
    unread = torch.ones(moc_arch.ffn_hidden_size, dtype=torch.bool)
    unread[kept] = False
    reader.rows[unread] = float("nan")
    with torch.no_grad():
        sparse, masked = reader(x.to(dtype)), mlp(x.to(dtype))[0]
    reference = masked_swiglu(x, fc1, fc2, GROUPS, KEPT)
    assert_close_to_reference(sparse, reference, dtype)
    assert_close_to_reference(sparse, masked, dtype)
    control = masked_swiglu(x, fc1, fc2, GROUPS, KEPT, rule=higher_index_channels)
    assert (control - reference).abs().max() > 0.2 * reference.abs().max()


def greedy(engine, prompts, new_tokens, static=False):
    """Greedy tokens and every step's logits from the engine (one left-padded batch)."""
    longest = max(map(len, prompts))
    cache = engine.new_cache(len(prompts), longest + new_tokens)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, longest - len(ids):] = torch.tensor(ids)
        cache.pad[row] = longest - len(ids)
    logits = engine.forward(tokens, cache)
    step = StaticDecodeStep(engine, cache, graph=False) if static else (lambda t: engine.forward(t, cache))
    chosen, seen = [], []
    for index in range(new_tokens):
        seen.append(logits[:, -1].clone())
        chosen.append(logits[:, -1].argmax(-1))
        if index < new_tokens - 1:
            logits = step(chosen[-1][:, None])
    return torch.stack(chosen, 1).tolist(), torch.stack(seen, 1)


def full_forward_greedy(model, ids, new_tokens):
    """The reference: argmax of the model's full forward over the whole sequence, every step."""
    ids = list(ids)
    for _ in range(new_tokens):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1].argmax()))
    return ids[-new_tokens:]


@pytest.mark.parametrize("region", [0, 2])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_sparse_decode_steps_give_the_masked_engines_tokens_and_logits(moc_arch, region, static):
    sharing = tuple(range(moc_arch.num_layers - region, moc_arch.num_layers))
    model = build_moc(moc_arch, sharing).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, moc_arch.vocab_size, (n,), generator=g).tolist() for n in (5, 2, 7)]
    masked_tokens, masked_logits = greedy(DecodeEngine(model, "reuse", moc_decode="masked"), prompts, 6, static)
    engine = DecodeEngine(model, "reuse", moc_decode="sparse")
    assert sorted(engine.moc_readers) == list(range(moc_arch.num_layers))
    sparse_tokens, sparse_logits = greedy(engine, prompts, 6, static)
    assert sparse_tokens == masked_tokens
    for row, ids in enumerate(prompts):
        assert sparse_tokens[row] == full_forward_greedy(model, ids, 6), f"row {row}"
    # the prefill (7 tokens per row) runs the MLP's own forward: the same bits
    assert torch.equal(sparse_logits[:, 0], masked_logits[:, 0])
    # decode steps: the same channels, another summation order
    torch.testing.assert_close(sparse_logits, masked_logits, rtol=1e-5, atol=1e-5)


def test_bf16_sparse_decode_is_close_to_masked(moc_arch):
    model = build_moc(moc_arch, precision="bf16").eval()
    prompts = [[5, 9, 200, 17], [3, 3]]
    _, masked = greedy(DecodeEngine(model, "qk", moc_decode="masked"), prompts, 4)
    _, sparse = greedy(DecodeEngine(model, "qk", moc_decode="sparse"), prompts, 4)
    torch.testing.assert_close(sparse, masked, rtol=5e-2, atol=5e-2)


def test_refusals(tiny_arch, moc_arch):
    dense = build(tiny_arch).eval()
    with pytest.raises(ConfigError, match="--moc-decode sparse: this model has no Mixture-of-Channels MLP"):
        DecodeEngine(dense, "qk", moc_decode="sparse")
    with pytest.raises(ConfigError, match="--moc-decode 'rows': choose one of masked, sparse"):
        DecodeEngine(build_moc(moc_arch).eval(), "qk", moc_decode="rows")


def test_down_bytes_by_hand():
    # 7B-like: 32 layers, h 4096, f 11008 in 8 groups of 1376, topk 0.2 -> k 275, K 2200; bf16
    counted = down_bytes_per_step(32, 4096, 11008, 8, 0.2, batch=1, bytes_per_element=2)
    assert counted.masked == 32 * 4096 * 11008 * 2
    assert counted.sparse == 32 * 1 * 2200 * 4096 * 2
    assert down_bytes_per_step(32, 4096, 11008, 8, 0.2, batch=8, bytes_per_element=2).sparse == 8 * counted.sparse
