"""Attention over the KV cache, split into its two halves so a sharing layer can skip the first.

``probabilities`` is ``softmax(Q Kᵀ · scale + mask)``; ``attend`` is ``P · V``. A computing layer
runs both. A sharing layer of a ``qk`` model (EPAS) has the source's Q and K, so the source's
probabilities *are* its probabilities: with probability reuse it runs only ``attend`` over its
own V -- no K read, no ``Q Kᵀ``, no softmax -- and the result is exact, not an approximation.

GQA without repeating K/V: the ``np = g · q`` query heads are grouped per KV group, so one
batched matmul per group serves its ``q`` heads (Megatron orders query heads group-major).
Scores and the softmax are computed in fp32; ``P`` is kept in fp32 and cast to V's dtype for the
product.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_queries(query: Tensor, num_query_groups: int) -> Tensor:
    """``[n, b, np, hn]`` (np = g · q, group-major) -> ``[b, g, q · n, hn]``."""
    n, b, heads, head_dim = query.shape
    # [n, b, np, hn] -> [b, np, n, hn] -> [b, g, q * n, hn]
    return query.permute(1, 2, 0, 3).reshape(b, num_query_groups, (heads // num_query_groups) * n, head_dim)


def ungroup_context(context: Tensor, num_heads: int, n: int) -> Tensor:
    """``[b, g, q · n, hn]`` -> ``[n, b, np · hn]`` (the layout ``linear_proj`` takes)."""
    b, _, _, head_dim = context.shape
    # [b, g, q * n, hn] -> [b, np, n, hn] -> [n, b, np, hn] -> [n, b, np * hn]
    return context.reshape(b, num_heads, n, head_dim).permute(2, 0, 1, 3).reshape(n, b, num_heads * head_dim)


def attention_mask(pad: Tensor, start: int, n: int, queries_per_group: int) -> Tensor:
    """Allowed (True) key slots ``[b, 1, q · n, start + n]`` for new tokens at slots
    ``start .. start + n``: causal, and no left-padding slot -- except that a padding token sees
    itself, so its (never used) row stays finite."""
    device = pad.device
    end = start + n
    slots = torch.arange(end, device=device)  # key slots
    new = torch.arange(start, end, device=device)  # query slots
    # [n, T]: causal; [b, 1, T]: not padding
    causal = slots[None, :] <= new[:, None]
    real = slots[None, None, :] >= pad[:, None, None]
    itself = slots[None, :] == new[:, None]
    allowed = causal[None] & (real | itself[None])  # [b, n, T]
    # [b, n, T] -> [b, 1, q * n, T] (query rows are head-major within a group: q blocks of n)
    return allowed.unsqueeze(1).repeat(1, 1, queries_per_group, 1)


def probabilities(grouped_query: Tensor, keys: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``softmax(Q Kᵀ · scale)`` over allowed slots: ``[b, g, m, hn] x [b, g, T, hn] -> [b, g, m, T]``
    (fp32)."""
    # [b, g, m, hn] @ [b, g, hn, T] -> [b, g, m, T]
    scores = torch.matmul(grouped_query.float(), keys.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


def attend(probs: Tensor, values: Tensor) -> Tensor:
    """``P · V``: ``[b, g, m, T] x [b, g, T, hn] -> [b, g, m, hn]`` in V's dtype."""
    return torch.matmul(probs.to(values.dtype), values)
