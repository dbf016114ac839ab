"""The kept-token draw (uniform, sorted, keyed by sample and layer: random_ltd/keyed_draw.py) and
gather/scatter (random_ltd/tokens.py)."""

import pytest
import torch

from epas_megatron.errors import ConfigError
from epas_megatron.random_ltd.keyed_draw import generator_seeds, kept_index, kept_token_indices, smallest_keys_sorted, uniform_keys
from epas_megatron.random_ltd.tokens import gather_rotary, gather_rows, gather_tokens, scatter_tokens, token_ops

_M64 = (1 << 64) - 1


def reference_seed(seed, sample, layer):
    """splitmix64 over (seed, sample, layer), shifted right by one: the keyed generator's seed."""
    state = 0x9E3779B97F4A7C15
    for value in (seed, sample, layer):
        state = ((state ^ (value & _M64)) + 0x9E3779B97F4A7C15) & _M64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        state = z ^ (z >> 31)
    return state >> 1


def reference_draw(sample_ids, layers, s, r, seed):
    """The per-(sample, layer) draw as first written: a generator seeded with the keyed seed,
    s uniform keys, the r smallest (torch.argsort's order), sorted by position."""
    out = torch.empty(len(layers), len(sample_ids), r, dtype=torch.int64)
    generator = torch.Generator()
    for j, sample in enumerate(sample_ids):
        for i, layer in enumerate(layers):
            generator.manual_seed(reference_seed(seed, sample, layer))
            keys = torch.rand(s, generator=generator)
            out[i, j] = torch.sort(torch.argsort(keys)[:r]).values
    return out


@pytest.mark.parametrize("sample_ids, layers, s, r, seed", [
    ([3, 4, 5], [1, 2], 32, 10, 1),
    ([0, 7, 2**40 + 3], [0, 5, 11], 1300, 1299, -3),   # three MT19937 blocks, all but one kept, big ids
    (list(range(100, 104)), [2, 9], 2048, 256, 2**70 + 5),  # a seed wider than 64 bits
    ([9], [1], 17, 1, 0),
])
def test_draw_is_the_per_pair_generator_draw(sample_ids, layers, s, r, seed):
    expected = reference_draw(sample_ids, layers, s, r, seed)
    assert torch.equal(kept_token_indices(sample_ids, layers, s, r, seed), expected)
    assert torch.equal(kept_token_indices(torch.tensor(sample_ids), layers, s, r, seed), expected)
    assert torch.equal(kept_index(torch.tensor(sample_ids), layers, s, r, seed, "cpu"), expected)


def test_a_tie_at_the_boundary_keeps_the_per_pair_draws_choice():
    """(seed 0, sample 31, layer 7), s 4096, r 2048: the 2048th and 2049th smallest keys are equal,
    and the per-pair draw's argsort keeps the later position of the two."""
    keys = uniform_keys(generator_seeds(torch.tensor([31]), torch.tensor([7]), 0).reshape(-1), 4096)[0]
    ordered = torch.sort(keys).values
    assert ordered[2047] == ordered[2048]  # the case is a boundary tie ...
    by_position = torch.sort(torch.topk(keys * 4096 + torch.arange(4096), 2048, largest=False).indices).values
    expected = reference_draw([31], [7], 4096, 2048, 0)[0, 0]
    assert not torch.equal(by_position, expected)  # ... that position order would break differently
    assert torch.equal(kept_token_indices([31], [7], 4096, 2048, seed=0)[0, 0], expected)


def test_selection_follows_argsort_on_ties():
    """Keys with ties everywhere (8 values): every row as torch.argsort of the float keys picks."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randint(0, 8, (64, 40), generator=generator) * 2**20
    for r in (1, 5, 17, 39, 40):
        got = smallest_keys_sorted(keys, r)
        for row, key_row in zip(got, keys):
            assert torch.equal(row, torch.sort(torch.argsort(key_row.float() * 2.0**-24)[:r]).values)


def test_keys_are_torch_rand_and_the_device_program_agrees():
    """The 24-bit keys are torch.rand's for each seed (both seeding programs: numpy on the host,
    PyTorch ops as on a GPU), and the seeds are the keyed ones (the low 32 bits kept)."""
    seeds = generator_seeds(torch.tensor([5, 2**33]), torch.tensor([0, 3]), 42)
    expected_seeds = [[reference_seed(42, s, l) & 0xFFFFFFFF for s in (5, 2**33)] for l in (0, 3)]
    assert seeds.tolist() == expected_seeds
    rows = []
    for k in seeds.reshape(-1).tolist():
        rows.append((torch.rand(1500, generator=torch.Generator().manual_seed(k)).double() * 2**24).long())
    expected = torch.stack(rows)
    for program in ("numpy", "torch"):
        assert torch.equal(uniform_keys(seeds.reshape(-1), 1500, program), expected), program


def test_the_device_program_reads_no_value_back():
    """Ids on a device are drawn there: on meta tensors (shapes, no values) the whole draw runs,
    so nothing in it reads a value back to the host (which on a GPU would synchronise)."""
    index = kept_token_indices(torch.arange(4, device="meta"), [1, 2], 700, 100, seed=3)
    assert index.shape == (2, 4, 100) and index.device.type == "meta"
    assert kept_index(torch.arange(4), [1, 2], 32, 8, 3, "meta").device.type == "meta"


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
