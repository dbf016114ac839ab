"""The kept-token draw (uniform, sorted, keyed by sample and layer) and gather/scatter."""

import pytest
import torch

from epas_megatron.errors import ConfigError
from epas_megatron.random_ltd.tokens import (
    gather_rotary, gather_rows, gather_tokens, kept_token_indices, scatter_tokens, token_ops,
)


def test_draw_is_sorted_distinct_and_keyed():
    index = kept_token_indices([3, 4, 5], [1, 2], 32, 10, seed=1)
    assert index.shape == (2, 3, 10)
    for row in index.reshape(-1, 10):
        assert torch.equal(row, torch.sort(row).values) and len(set(row.tolist())) == 10
    # the same (sample, layer) draws the same tokens whatever else is in the micro-batch or chunk
    alone = kept_token_indices([4], [2], 32, 10, seed=1)
    assert torch.equal(alone[0, 0], index[1, 1])
    assert not torch.equal(index[0, 0], index[1, 0]) and not torch.equal(index[0, 0], index[0, 1])
    assert not torch.equal(kept_token_indices([3], [1], 32, 10, seed=2)[0, 0], index[0, 0])


def test_draw_is_uniform():
    """Every position is kept with probability r/s (a chi-square bound over 4000 draws)."""
    s, r = 16, 4
    index = kept_token_indices(list(range(2000)), [0, 1], s, r, seed=0)
    counts = torch.bincount(index.reshape(-1), minlength=s).double()
    expected = index.numel() / s
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 37.7  # 15 degrees of freedom, p = 0.001


def test_gather_scatter_against_a_loop():
    torch.manual_seed(0)
    hidden = torch.randn(8, 2, 3, requires_grad=True)
    index = torch.tensor([[0, 3, 5], [1, 2, 7]])
    kept = gather_tokens(hidden, index)
    for b in range(2):
        assert torch.equal(kept[:, b], hidden[index[b], b])
    layer_out = kept * 2 + 1
    out = scatter_tokens(hidden, layer_out, index)
    expected = hidden.detach().clone()
    for b in range(2):
        expected[index[b], b] = hidden.detach()[index[b], b] * 2 + 1
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    grad = torch.ones(8, 2, 3)
    for b in range(2):
        grad[index[b], b] = 2.0  # kept rows: through the layer (x2); dropped rows: skip it (x1)
    torch.testing.assert_close(hidden.grad, grad)


def test_rows_and_rotary():
    t = torch.arange(8 * 2 * 3 * 4, dtype=torch.float32).reshape(8, 2, 3, 4)
    index = torch.tensor([[1, 4], [0, 6]])
    rows = gather_rows(t, index)
    assert torch.equal(rows[:, 1], t[[0, 6], 1]) and torch.equal(rows[:, 0], t[[1, 4], 0])
    freqs = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 1, 1, 4)
    pair = gather_rotary((freqs, freqs), index)
    assert pair[0].shape == (2, 2, 1, 4) and torch.equal(pair[1][:, 1, 0], freqs[[0, 6], 0, 0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_kernel_choice_on_cpu():
    assert type(token_ops("auto")).__name__ == "TorchTokenOps"
    with pytest.raises(ConfigError, match="--random-ltd-kernels deepspeed"):
        token_ops("deepspeed")
    with pytest.raises(ConfigError, match="choose one of"):
        token_ops("cuda")
