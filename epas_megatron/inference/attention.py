"""Attention over the KV cache, split into its two halves so a sharing layer can skip the first.

``probabilities`` is ``softmax(Q Kᵀ · scale + mask)``; ``attend`` is ``P · V``. A computing layer
runs both. A sharing layer of a ``qk`` model (EPAS) has the source's Q and K, so the source's
probabilities *are* its probabilities: with probability reuse it runs only ``attend`` over its
own V -- no K read, no ``Q Kᵀ``, no softmax -- and the result is exact, not an approximation.

GQA without repeating K/V: the ``np = g · q`` query heads are grouped per KV group, so one
batched matmul per group serves its ``q`` heads (Megatron orders query heads group-major).

Precision (decided for the GPU, where a decode step is bound by reading the cache):

* ``Q Kᵀ`` reads K **as it is cached** (the model's dtype). On CUDA with bf16/fp16 operands the
  scores come out of one ``torch.bmm(..., out_dtype=torch.float32)``: cuBLAS multiplies the
  half-precision operands, accumulates in fp32 and writes fp32 scores -- no fp32 copy of the
  cache (an earlier version upcast Q and the whole K cache per layer per token, which reads and
  writes three times the cache's bytes). Where that overload is missing (torch older than 2.8)
  the scores are a half-precision matmul's output, rounded once, then upcast. On CPU (fp32 in
  practice) half-precision operands are upcast first, which computes what the CUDA path computes.
* The scale, the mask and the softmax run in fp32 over the small ``[b, g, q · n, T]`` scores.
* ``P`` is cast to the model's dtype once, by the layer that computes it (sharing layers that
  reuse it read that copy), and ``P · V`` is a half-precision matmul (fp32 accumulation inside
  cuBLAS / the CPU kernels, output rounded once).

Masks are *blocked* slots ``[b, 1, n, T]`` (True: may not attend), applied to the scores viewed
as ``[b, g, q, n, T]`` by broadcasting, so no per-head copy of the mask is made.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()
"""``torch.bmm(a, b, out_dtype=torch.float32)`` for bf16/fp16 operands (CUDA kernels only)."""


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


def blocked_slots(pad: Tensor, new: Tensor, visible: int) -> Tensor:
    """Key slots ``[b, 1, n, visible]`` the new tokens at slots ``new [n]`` may *not* attend to
    (True): later slots, and left-padding slots -- except that a padding token sees itself, so
    its (never used) row stays finite. ``new`` is a tensor, so a fixed-shape decode step can pass
    its write slot without a Python-side shape change."""
    slots = torch.arange(visible, device=pad.device)  # key slots
    # [n, T]: causal; [b, 1, T]: not padding; [n, T]: the token's own slot
    causal = slots[None, :] <= new[:, None]
    real = slots[None, None, :] >= pad[:, None, None]
    itself = slots[None, :] == new[:, None]
    allowed = causal[None] & (real | itself[None])  # [b, n, T]
    # [b, n, T] -> [b, 1, n, T]
    return (~allowed).unsqueeze(1)


def fp32_scores(grouped_query: Tensor, keys: Tensor) -> Tensor:
    """``Q Kᵀ`` in fp32 from operands in the model's dtype (see module doc):
    ``[b, g, m, hn] x [b, g, T, hn] -> [b, g, m, T]``."""
    if grouped_query.dtype == torch.float32:
        # [b, g, m, hn] @ [b, g, hn, T] -> [b, g, m, T]
        return torch.matmul(grouped_query, keys.transpose(-1, -2))
    if grouped_query.is_cuda:
        if _BMM_OUT_DTYPE:
            b, g, m, head_dim = grouped_query.shape
            # [b, g, m, hn] -> [b * g, m, hn]; [b, g, T, hn] -> [b * g, hn, T] (views of the cache, no copy)
            scores = torch.bmm(grouped_query.reshape(b * g, m, head_dim), keys.flatten(0, 1).transpose(1, 2),
                               out_dtype=torch.float32)
            # [b * g, m, T] -> [b, g, m, T]
            return scores.view(b, g, m, keys.size(2))
        return torch.matmul(grouped_query, keys.transpose(-1, -2)).float()
    return torch.matmul(grouped_query.float(), keys.float().transpose(-1, -2))


def probabilities(grouped_query: Tensor, keys: Tensor, blocked: Tensor, scale: float,
                  dtype: torch.dtype | None = None) -> Tensor:
    """``softmax(Q Kᵀ · scale)`` over the slots not ``blocked``: ``[b, g, m, hn] x [b, g, T, hn]
    -> [b, g, m, T]``, computed in fp32 and returned in ``dtype`` (default: the keys' dtype)."""
    scores = fp32_scores(grouped_query, keys)
    b, g, m, slots = scores.shape
    n = blocked.size(2)
    scores.mul_(scale)
    # [b, g, q * n, T] viewed as [b, g, q, n, T]; blocked [b, 1, n, T] -> [b, 1, 1, n, T]
    scores.view(b, g, m // n, n, slots).masked_fill_(blocked.unsqueeze(2), float("-inf"))
    return torch.softmax(scores, dim=-1).to(keys.dtype if dtype is None else dtype)


def attend(probs: Tensor, values: Tensor) -> Tensor:
    """``P · V``: ``[b, g, m, T] x [b, g, T, hn] -> [b, g, m, hn]`` in V's dtype."""
    return torch.matmul(probs.to(values.dtype), values)
