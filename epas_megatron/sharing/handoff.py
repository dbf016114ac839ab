"""The hand-off: the source layer's post-RoPE Q/K (or K/V) travelling to the sharing layers.

One flat, contiguous tensor carries both parts, ``[first.numel() + second.numel()]``; the parts
are recovered as contiguous *views* (:func:`unpack`), so sharing layers read the source's
tensors without copying them, and the hand-off can be a plain tensor argument of activation
checkpointing and of pipeline send/receive. The source packs once per forward (one copy of its
Q and K, i.e. ``s*b*(np+ng)*hn`` elements per micro-batch); its own attention then also runs on
views of the packed tensor, so no second copy stays alive for backward.

Across a pipeline stage boundary inside the sharing region the hand-off rides in the same p2p
tensor as the hidden states (:func:`pack_for_p2p` / :func:`unpack_from_p2p`): the buffer is
``[hidden.flatten() | handoff | zero padding]`` viewed as ``[s_local + r, b, h]``, i.e. ``r``
extra sequence rows (:func:`extra_p2p_rows`), and both parts come out of the received buffer as
contiguous views. Megatron's schedules use one p2p shape for every boundary, so while any
boundary lies inside the region, all boundaries send ``s_local + r`` rows (the others padding).
We do not use Megatron's ``variable_seq_lengths`` shape exchange: its shape messages are posted
in an order that pairs the wrong send and receive when PP=2 (prev and next rank are the same
peer), which breaks interleaved schedules.

Bytes per micro-batch per boundary: ``bytes_per_element * b * h * (s_local + r)`` with
``r = ceil(s * (np + ng) / tp * hn / h)`` ('qk') -- for MHA and TP=1 twice the hidden states.
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


def extra_p2p_rows(handoff_width: int, seq_length: int, hidden_size: int) -> int:
    """Rows of ``hidden_size`` elements that one micro-batch's hand-off needs in a p2p tensor.

    ``handoff_width``: hand-off elements per token on this TP rank (``(np + ng) / tp * hn``).
    """
    return -(-handoff_width * seq_length // hidden_size)


def pack_for_p2p(hidden_states: torch.Tensor, handoff, total_rows: int) -> torch.Tensor:
    """``[hidden | hand-off | zeros]`` as one ``[total_rows, b, h]`` tensor for the next stage.

    Every stage boundary of a pipeline uses the same ``total_rows`` (Megatron's schedules use one
    p2p shape); boundaries outside the sharing region carry no hand-off, only padding.
    """
    s_local, batch, hidden = hidden_states.shape
    parts = [hidden_states.reshape(-1)]
    used = hidden_states.numel()
    if handoff is not None:
        parts.append(handoff)
        used += handoff.numel()
    capacity = total_rows * batch * hidden
    if used > capacity:
        raise RuntimeError(f"hand-off does not fit the p2p tensor: {used} > {capacity} elements")
    if used < capacity:
        parts.append(hidden_states.new_zeros(capacity - used))
    packed = torch.cat(parts).view(total_rows, batch, hidden)
    return make_viewless_tensor(inp=packed, requires_grad=True, keep_graph=True)


def unpack_from_p2p(received: torch.Tensor, hidden_rows: int, handoff_numel: int):
    """Inverse of :func:`pack_for_p2p`: contiguous views of the hidden states and the hand-off
    (None when ``handoff_numel`` is 0)."""
    total_rows, batch, hidden = received.shape
    n_hidden = hidden_rows * batch * hidden
    if n_hidden + handoff_numel > received.numel():
        raise RuntimeError(
            f"received a [{total_rows}, {batch}, {hidden}] tensor, too small for {hidden_rows} rows of "
            f"hidden states plus a {handoff_numel}-element hand-off: the stages disagree on the region"
        )
    flat = received.view(-1)
    hidden_states = flat[:n_hidden].view(hidden_rows, batch, hidden)
    handoff = flat[n_hidden : n_hidden + handoff_numel] if handoff_numel else None
    return hidden_states, handoff
