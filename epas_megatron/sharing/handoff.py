"""The hand-off: the source layer's post-RoPE Q/K (or K/V) travelling to the sharing layers.

One flat, contiguous tensor carries both parts, ``[first.numel() + second.numel()]``; the parts
are recovered as contiguous *views* (:func:`unpack`), so sharing layers read the source's
tensors without copying them, and the hand-off can be a plain tensor argument of activation
checkpointing and of pipeline send/receive. The source packs once per forward (one copy of its
Q and K, i.e. ``s*b*(np+ng)*hn`` elements per micro-batch); its own attention then also runs on
views of the packed tensor, so no second copy stays alive for backward.

Across a pipeline stage boundary inside the sharing region the hand-off rides in the same p2p
tensor as the hidden states (:func:`pack_for_p2p` / :func:`unpack_from_p2p`): the send buffer is
``[hidden.flatten() | handoff]`` viewed as ``[s_local, b, h + extra]`` so that Megatron-Core's
shape exchange (``variable_seq_lengths``) carries it, and both parts come out of the received
buffer as contiguous views. Bytes per micro-batch per boundary:
``4 (fp32) or 2 (bf16) * s * b * (h/ (tp if SP else 1) + (np + ng) * hn / tp)``, i.e. the hidden
states plus the TP-local Q/K.
"""

from __future__ import annotations

import torch

from megatron.core.utils import make_viewless_tensor


def pack(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[first | second]`` flattened into one new contiguous 1-D tensor."""
    # [s, b, n1, hn], [s, b, n2, hn] -> [s*b*(n1+n2)*hn]
    return torch.cat((first.reshape(-1), second.reshape(-1)))


def unpack(
    handoff: torch.Tensor, seq_len: int, batch: int, first_heads: int, second_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous views ``[s, b, first_heads, hn]`` and ``[s, b, second_heads, hn]``."""
    n1 = seq_len * batch * first_heads * head_dim
    n2 = seq_len * batch * second_heads * head_dim
    if handoff.numel() != n1 + n2:
        raise RuntimeError(
            f"QK hand-off has {handoff.numel()} elements, expected {n1 + n2} for "
            f"[s={seq_len}, b={batch}, heads={first_heads}+{second_heads}, hn={head_dim}]"
        )
    first = handoff[:n1].view(seq_len, batch, first_heads, head_dim)
    second = handoff[n1:].view(seq_len, batch, second_heads, head_dim)
    return first, second


def pack_for_p2p(hidden_states: torch.Tensor, handoff: torch.Tensor) -> torch.Tensor:
    """Hidden states ``[s_l, b, h]`` plus the flat hand-off -> one ``[s_l, b, h + extra]``."""
    s_local, batch, hidden = hidden_states.shape
    per_row = s_local * batch
    if handoff.numel() % per_row:
        raise RuntimeError(
            f"hand-off of {handoff.numel()} elements does not tile [{s_local}, {batch}, *]"
        )
    extra = handoff.numel() // per_row
    packed = torch.cat((hidden_states.reshape(-1), handoff)).view(s_local, batch, hidden + extra)
    return make_viewless_tensor(inp=packed, requires_grad=True, keep_graph=True)


def unpack_from_p2p(received: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_for_p2p`: contiguous views of the hidden states and hand-off."""
    s_local, batch, width = received.shape
    if width <= hidden_size:
        raise RuntimeError(
            f"expected a hidden-state + QK hand-off tensor from the previous pipeline stage, got "
            f"width {width} <= hidden size {hidden_size}: the stages disagree on the sharing region"
        )
    flat = received.view(-1)
    n_hidden = s_local * batch * hidden_size
    return flat[:n_hidden].view(s_local, batch, hidden_size), flat[n_hidden:]
