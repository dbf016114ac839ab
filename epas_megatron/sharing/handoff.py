"""The hand-off: the source layer's post-RoPE Q/K (or K/V) travelling to the sharing layers.

Inside a pipeline stage the hand-off is the pair of tensors the source's attention itself uses,
``(query [s, b, np, hn], key [s, b, ng, hn])`` (or ``(key, value)`` for KV sharing): no copy is
made, every sharing layer reads the same tensors, and their gradients accumulate into them. The
pair rides in the layers' ``context`` slot and enters activation-recompute chunks as two tensor
arguments, so recomputation replays exactly the tensors of its micro-batch.

Across a pipeline stage boundary inside the sharing region the hand-off rides in the same p2p
tensor as the hidden states (:func:`pack_for_p2p` / :func:`unpack_from_p2p`): the buffer is
``[hidden.flatten() | first.flatten() | second.flatten() | zero padding]`` viewed as
``[s_local + r, b, h]``, i.e. ``r`` extra sequence rows (:func:`extra_p2p_rows`), and the parts
come out of the received buffer as contiguous views. Megatron's schedules use one p2p shape for
every boundary, so while any boundary lies inside the region, all boundaries send
``s_local + r`` rows (the others padding). We do not use Megatron's ``variable_seq_lengths``
shape exchange: its shape messages are posted in an order that pairs the wrong send and receive
when PP=2 (prev and next rank are the same peer), which breaks interleaved schedules.

Bytes per micro-batch per boundary: ``bytes_per_element * b * h * (s_local + r)`` with
``r = ceil(s * (np + ng) / tp * hn / h)`` ('qk') -- for MHA and TP=1 twice the hidden states.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron.core.utils import make_viewless_tensor

Handoff = tuple[torch.Tensor, torch.Tensor]


def extra_p2p_rows(handoff_width: int, seq_length: int, hidden_size: int) -> int:
    """Rows of ``hidden_size`` elements that one micro-batch's hand-off needs in a p2p tensor.

    ``handoff_width``: hand-off elements per token on this TP rank (``(np + ng) / tp * hn``).
    """
    return -(-handoff_width * seq_length // hidden_size)


def pack_for_p2p(hidden_states: torch.Tensor, handoff: Optional[Handoff], total_rows: int) -> torch.Tensor:
    """``[hidden | hand-off | zeros]`` as one ``[total_rows, b, h]`` tensor for the next stage.

    Every stage boundary of a pipeline uses the same ``total_rows`` (Megatron's schedules use one
    p2p shape); boundaries outside the sharing region carry no hand-off, only padding.
    """
    s_local, batch, hidden = hidden_states.shape
    parts = [hidden_states.reshape(-1)]
    if handoff is not None:
        parts.extend(t.reshape(-1) for t in handoff)
    used = sum(t.numel() for t in parts)
    capacity = total_rows * batch * hidden
    if used > capacity:
        raise RuntimeError(f"hand-off does not fit the p2p tensor: {used} > {capacity} elements")
    if used < capacity:
        parts.append(hidden_states.new_zeros(capacity - used))
    packed = torch.cat(parts).view(total_rows, batch, hidden)
    return make_viewless_tensor(inp=packed, requires_grad=True, keep_graph=True)


def unpack_from_p2p(received: torch.Tensor, hidden_rows: int, handoff_shapes: Optional[Sequence[tuple]] = None):
    """Inverse of :func:`pack_for_p2p`: contiguous views of the hidden states and of the
    hand-off tensors of the given shapes (None without shapes)."""
    total_rows, batch, hidden = received.shape
    flat = received.view(-1)
    n_hidden = hidden_rows * batch * hidden
    sizes = [int(torch.Size(shape).numel()) for shape in (handoff_shapes or ())]
    if n_hidden + sum(sizes) > flat.numel():
        raise RuntimeError(
            f"received a [{total_rows}, {batch}, {hidden}] tensor, too small for {hidden_rows} rows of "
            f"hidden states plus a hand-off of shapes {list(handoff_shapes)}: the stages disagree on the region"
        )
    hidden_states = flat[:n_hidden].view(hidden_rows, batch, hidden)
    if not handoff_shapes:
        return hidden_states, None
    parts, offset = [], n_hidden
    for shape, size in zip(handoff_shapes, sizes):
        parts.append(flat[offset : offset + size].view(shape))
        offset += size
    return hidden_states, tuple(parts)
