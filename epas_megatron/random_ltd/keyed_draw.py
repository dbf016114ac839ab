"""The keyed draw of Random-LTD's kept tokens: which ``r`` of ``s`` positions each (sample,
layer) keeps.

**Selection.** Each Random-LTD layer keeps ``r`` tokens of every sequence, drawn uniformly
without replacement and sorted by position (DeepSpeed's ``gpt_sample_tokens``: multinomial over
uniform weights, then ``token_sort_``); layers draw independently. The draw is keyed, not taken
from a global generator: the tokens of (sample, layer) are the ``r`` smallest of ``s`` uniform
keys drawn from a generator seeded with ``(seed, sample id, layer)``, where the sample id is the
sample's position in the training stream. So every TP rank, pipeline stage and data-parallel
split of the same global batch keeps the same tokens (runs are layout-independent), activation
recompute replays them, and a resume draws what the uninterrupted run drew.

**How the draw is computed (one pass per micro-batch, no Python loop over samples).** The keyed
generator is, by definition, PyTorch's CPU generator: ``torch.Generator().manual_seed(k)`` with
``k = splitmix64(seed, sample, layer)``, then ``torch.rand(s)`` and the ``r`` smallest keys (the
first ``r`` of ``torch.argsort``), sorted. That is what the first Random-LTD runs drew, and
their checkpoints resume with it, so the definition stays. :func:`kept_token_indices` computes
exactly those tokens with tensor operations over all (layer, sample) pairs at once: PyTorch's
generator is MT19937 (``at::mt19937``, seeded with the low 32 bits of ``k``) and ``torch.rand``
of float32 is ``(next_uint32 & (2^24 - 1)) * 2^-24``, so the keys are 24-bit integers; the
seeding recurrence, the state twist and the tempering run vectorised over the pairs, and the
``r`` smallest keys (ties by position) come from one ``topk``. Ties decide nothing unless the
``r``-th and ``(r+1)``-th smallest keys are equal (about ``s / 2^24`` of the rows: 1e-4 at
``s = 2048``); on the host such rows are redone with ``torch.argsort`` of the float keys, the
very sort (and tie order) of the original per-pair draw, so host draws are identical to it,
row for row. ``tests/random_ltd/test_tokens.py`` checks both against the per-pair draw written out.

**Host or device.** Sample ids normally stay on the host (``forward_step`` keeps them there):
the draw then runs on the CPU and the ``[layers, b, r]`` index goes to the GPU as one
asynchronous copy from pinned memory (:func:`kept_index`); nothing waits for the GPU, and the
host work overlaps the GPU's queue (8 sequences x 22 layers at s 2048: ~17 ms on one core of
the shared 2-core CPU machine, against ~25 ms for the per-pair loop it replaces; the seeding
recurrence, 623 sequential steps, runs in numpy). Ids that already live on a GPU are drawn
there with the same tensor program, so no value is ever read back (no synchronisation) -- at
the price of that recurrence's ~2.5k tiny kernel launches per micro-batch, and with one
documented difference: on the device, tied keys at the boundary are broken by position (the
device cannot replay the host sort's tie order), which changes about one row in ``2^24 / s``.
A run draws the same tokens on every rank and at every resume either way, as long as its ids
stay on one side, which ``forward_step`` guarantees.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_KEY_BITS = 24  # torch.rand's float32 keys: 24 random bits (the mantissa)

# splitmix64 (the seed of each (sample, layer) from the run's seed)
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# MT19937 (at::mt19937, the engine of PyTorch's CPU generator)
_MT_N, _MT_M = 624, 397
_MT_SEED_MULT = 1812433253
_MT_UPPER, _MT_LOWER, _MT_MATRIX_A = 0x80000000, 0x7FFFFFFF, 0x9908B0DF


def _absorb(state: int, value: int) -> int:
    """One splitmix64 step: ``state`` absorbs ``value`` (Python integers, unsigned 64-bit)."""
    z = ((state ^ (int(value) & _MASK64)) + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _signed(value: int) -> int:
    """The int64 with the bits of the unsigned 64-bit ``value`` (tensors hold int64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical (unsigned) right shift of int64 ``x`` (PyTorch's ``>>`` is arithmetic)."""
    return torch.bitwise_and(torch.bitwise_right_shift(x, bits), (1 << (64 - bits)) - 1)


def _absorb_tensor(state: Tensor, value: Tensor) -> Tensor:
    """:func:`_absorb` on int64 tensors: additions and products wrap around (two's complement),
    i.e. they are the unsigned arithmetic mod 2^64 bit for bit."""
    z = torch.bitwise_xor(state, value) + _signed(_GOLDEN)
    z = torch.bitwise_xor(z, _shift_right(z, 30)) * _signed(_MIX1)
    z = torch.bitwise_xor(z, _shift_right(z, 27)) * _signed(_MIX2)
    return torch.bitwise_xor(z, _shift_right(z, 31))


def generator_seeds(sample_ids: Tensor, layers: Tensor, seed: int) -> Tensor:
    """``[L, b]`` (int64) seeds of the (layer, sample) generators: the low 32 bits of
    ``splitmix64(seed, sample, layer) >> 1`` -- all that ``torch.Generator.manual_seed`` keeps
    (``at::mt19937`` seeds from ``seed & 0xffffffff``)."""
    run = torch.full_like(sample_ids, _signed(_absorb(_GOLDEN, seed)))  # [b]
    per_sample = _absorb_tensor(run, sample_ids)  # [b]
    per_pair = _absorb_tensor(per_sample.unsqueeze(0), layers.unsqueeze(1))  # [1, b] x [L, 1] -> [L, b]
    return torch.bitwise_and(_shift_right(per_pair, 1), _MASK32)


def _mt_seeded_states_numpy(seeds: Tensor) -> Tensor:
    """MT19937 states after seeding (``init_genrand``), ``[624, G]`` int64, for ``[G]`` CPU
    seeds. The 623-step recurrence is sequential, so it runs over all generators at once in numpy
    (uint32 arithmetic wraps; ~4x less per-call overhead than PyTorch ops on small arrays)."""
    state = np.empty((_MT_N, seeds.numel()), dtype=np.uint32)
    state[0] = seeds.numpy().astype(np.uint32)
    mult = np.uint32(_MT_SEED_MULT)
    for i in range(1, _MT_N):
        prev, row = state[i - 1], state[i]
        # state[i] = 1812433253 * (state[i-1] ^ (state[i-1] >> 30)) + i  (mod 2^32)
        np.right_shift(prev, 30, out=row)
        np.bitwise_xor(row, prev, out=row)
        np.multiply(row, mult, out=row)
        np.add(row, np.uint32(i), out=row)
    return torch.from_numpy(state.astype(np.int64))


def _mt_seeded_states_torch(seeds: Tensor) -> Tensor:
    """:func:`_mt_seeded_states_numpy` with PyTorch ops on ``seeds``' device (four small
    kernels per step; values stay below 2^63, so nothing overflows)."""
    state = torch.empty(_MT_N, seeds.numel(), dtype=torch.int64, device=seeds.device)
    state[0] = seeds
    offsets = torch.arange(_MT_N, device=seeds.device)
    scratch = torch.empty_like(seeds)
    for i in range(1, _MT_N):
        prev = state[i - 1]
        torch.bitwise_right_shift(prev, 30, out=scratch)
        scratch.bitwise_xor_(prev)
        torch.add(offsets[i], scratch, alpha=_MT_SEED_MULT, out=scratch)
        torch.bitwise_and(scratch, _MASK32, out=state[i])
    return state


def _mt_twist_term(y: Tensor) -> Tensor:
    return torch.bitwise_xor(torch.bitwise_right_shift(y, 1), torch.bitwise_and(y, 1) * _MT_MATRIX_A)


def _mt_twist(state: Tensor) -> Tensor:
    """The next ``[624, G]`` state (``next_state``), vectorised: ``new[i] = mt[i + 397] ^
    f(mt[i], mt[i + 1])``, where ``mt[i + 397]`` is already the new value for ``i >= 227``;
    so three blocks, each reading only rows finished before it."""
    n, m = _MT_N, _MT_M
    # y_i = upper bit of mt[i] | lower 31 bits of mt[i + 1], i < n - 1 (mt[n] is the new mt[0])
    y = torch.bitwise_or(torch.bitwise_and(state[:-1], _MT_UPPER), torch.bitwise_and(state[1:], _MT_LOWER))  # [623, G]
    term = _mt_twist_term(y)
    new = torch.empty_like(state)
    new[: n - m] = torch.bitwise_xor(state[m:], term[: n - m])  # rows 0..226: old rows 397..623
    new[n - m : 2 * (n - m)] = torch.bitwise_xor(new[: n - m], term[n - m : 2 * (n - m)])  # 227..453: new 0..226
    new[2 * (n - m) : n - 1] = torch.bitwise_xor(new[n - m : m - 1], term[2 * (n - m) :])  # 454..622: new 227..395
    y_last = torch.bitwise_or(torch.bitwise_and(state[n - 1], _MT_UPPER), torch.bitwise_and(new[0], _MT_LOWER))
    new[n - 1] = torch.bitwise_xor(new[m - 1], _mt_twist_term(y_last))
    return new


def _mt_temper(y: Tensor) -> Tensor:
    y = torch.bitwise_xor(y, torch.bitwise_right_shift(y, 11))
    y = torch.bitwise_xor(y, torch.bitwise_and(torch.bitwise_left_shift(y, 7), 0x9D2C5680))
    y = torch.bitwise_xor(y, torch.bitwise_and(torch.bitwise_left_shift(y, 15), 0xEFC60000))
    return torch.bitwise_xor(y, torch.bitwise_right_shift(y, 18))


def uniform_keys(seeds: Tensor, count: int, vectorised_seeding: Optional[str] = None) -> Tensor:
    """``[G, count]`` int64: ``torch.rand(count, generator=torch.Generator().manual_seed(k))
    * 2^24`` for each of the ``[G]`` 32-bit seeds ``k`` -- the first ``count`` MT19937 outputs,
    24 bits each (``at::uniform_real_distribution<float>``) -- on ``seeds``' device.
    ``vectorised_seeding``: 'numpy' or 'torch' (default: numpy for CPU seeds)."""
    backend = vectorised_seeding or ("numpy" if seeds.device.type == "cpu" else "torch")
    state = _mt_seeded_states_numpy(seeds) if backend == "numpy" else _mt_seeded_states_torch(seeds)
    blocks = []
    for start in range(0, count, _MT_N):  # the engine twists before its first output
        state = _mt_twist(state)
        blocks.append(_mt_temper(state[: min(_MT_N, count - start)]))
    # [count, G] -> [G, count]
    return torch.bitwise_and(torch.cat(blocks), (1 << _KEY_BITS) - 1).t().contiguous()


def smallest_keys_sorted(keys: Tensor, kept: int) -> Tensor:
    """``[G, s]`` keys -> ``[G, kept]`` positions of the ``kept`` smallest, sorted by position.

    The set is that of ``torch.argsort(keys_row)[:kept]`` on the CPU (the per-pair draw); it is
    unique unless the ``kept``-th and ``(kept + 1)``-th smallest keys tie. ``topk`` takes the
    smallest of the composite keys ``key * s + position`` (ties by position); on the CPU, rows
    with such a tie are redone with ``torch.argsort`` of the float32 keys, row by row the sort
    of the per-pair draw (its tie order), so the result equals it exactly. On a device the
    position order stands (no value is read back to find such rows)."""
    s = keys.size(1)
    positions = torch.arange(s, device=keys.device)
    composite = keys * s + positions  # [G, s], unique within a row
    chosen = torch.topk(composite, kept, dim=1, largest=False, sorted=False)
    index = torch.sort(chosen.indices, dim=1).values  # [G, kept]
    if keys.device.type == "cpu":
        largest_kept = torch.div(chosen.values.max(dim=1, keepdim=True).values, s, rounding_mode="floor")  # [G, 1]
        tied = (keys <= largest_kept).sum(dim=1) > kept  # [G]: a key equal to the largest kept one was dropped
        if bool(tied.any()):
            rows = tied.nonzero().squeeze(1)
            floats = keys[rows].to(torch.float32).mul_(2.0**-_KEY_BITS)  # exactly torch.rand's values
            index[rows] = torch.sort(torch.argsort(floats, dim=1)[:, :kept], dim=1).values
    return index


def kept_token_indices(sample_ids, layers: Sequence[int], seq_length: int, kept: int, seed: int) -> Tensor:
    """Sorted kept positions ``[len(layers), b, kept]`` (int64) of each layer and sample.

    ``sample_ids``: ``[b]`` ids (a tensor on any device, or a sequence of ints); the draw runs
    where they are and never reads a device value back (see the module doc)."""
    if not 0 < kept <= seq_length:
        raise ValueError(f"kept tokens must be in 1..{seq_length}, got {kept}")
    ids = torch.as_tensor(sample_ids, dtype=torch.int64).reshape(-1)  # [b]
    layer_ids = torch.as_tensor(list(layers), dtype=torch.int64)  # [L], host
    if ids.device.type == "cuda":
        layer_ids = layer_ids.pin_memory().to(ids.device, non_blocking=True)
    elif ids.device.type != "cpu":
        layer_ids = layer_ids.to(ids.device)
    if ids.numel() == 0 or layer_ids.numel() == 0:
        return torch.empty(layer_ids.numel(), ids.numel(), kept, dtype=torch.int64, device=ids.device)
    seeds = generator_seeds(ids, layer_ids, seed).reshape(-1)  # [L * b], layer-major
    keys = uniform_keys(seeds, seq_length)  # [L * b, s]
    # [L * b, kept] -> [L, b, kept]
    return smallest_keys_sorted(keys, kept).view(layer_ids.numel(), ids.numel(), kept)


def kept_index(sample_ids, layers: Sequence[int], seq_length: int, kept: int, seed: int, device) -> Tensor:
    """:func:`kept_token_indices` on ``device`` without synchronising: drawn where the ids are;
    a host draw reaches a GPU as one asynchronous copy from pinned memory."""
    index = kept_token_indices(sample_ids, layers, seq_length, kept, seed)
    device = torch.device(device)
    if index.device.type == "cpu" and device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device, non_blocking=True)
