"""The Mixture-of-Channels Top-K: which ``k`` channels of a group a token keeps.

A Mixture-of-Channels MLP keeps, per token and within each fixed group of channels, the ``k``
channels with the largest gate pre-activation ``G``. Every path that chooses them calls
:func:`topk_channels`: training's forward and its recompute (:mod:`epas_megatron.model.moc`,
``[s, b, groups, c]``), the sparse-read decode (:mod:`epas_megatron.inference.moc_decode`,
``[t, groups, c]``) and this export's ``EpasMoCMLP`` (:mod:`.modeling_epas_llama`,
``[b, s, groups, c]``).

**The rule.** Rank a group's channels by value, largest first, and among equal values by channel
index, the lower index first; keep the first ``k``. Equal means equal as numbers: ``-0.0`` ties
with ``+0.0``. The result is the channels in that rank order, so not only the set but the
tensor is a function of the group's values alone.

Why a rule and not ``torch.topk(k, sorted=False)``: with bf16 gate values a tie at the boundary
(the ``k``-th and ``(k+1)``-th largest equal) is common -- 4-17 % of (token, group) pairs (issue
#41); normal bf16 values in groups of 1,376 channels, ``k = 275`` (7B): about half -- and
``topk`` breaks it as its kernel likes, which may differ with the tensor's leading shape, the
tensor-parallel degree (each rank sees its own groups) and the device. Under the rule, TP = 1
and TP = 2, the decode step and the masked forward, training and the export keep the same
channels, ties included.

**How.** Values of up to 32 bits map to integers of twice their width whose order is the values'
order (IEEE sign and magnitude, read as a signed integer; ``-0.0`` folded onto ``+0.0``), times
``c``, plus ``c - 1 - index``. The keys of one group are then distinct, so their ``k`` largest
are one set that any ``topk`` kernel returns, on any device and in any leading shape; the rank
order comes from ``topk``'s sort of those ``k`` distinct keys. A 16-bit group (bf16, fp16) uses
``int32`` keys (``c`` up to 65,536), a 32-bit one ``int64``: 4 or 8 bytes per channel for a
moment (the keys are built in place), where a full sort would hold its sorted values and
``int64`` indices of every channel. Wider values (fp64: no room for the index beside 64 bits)
and 16-bit groups of more than 65,536 channels take a stable descending sort of the group, which
keeps equal values in index order -- the same rule. The same numbers
in another dtype (bf16 values cast to fp32 or fp64) give the same channels. A NaN (a diverged
run) gets a deterministic place too: by its bits in the key path (a positive NaN above +inf),
above every number in the sorting one.

This file ships inside every exported model directory: it imports only torch.
"""

from __future__ import annotations

import torch

_KEY_TYPES = {2: (torch.int16, torch.int32), 4: (torch.int32, torch.int64)}
"""Element bytes of the values -> (the integer type of the same width, the key's integer type)."""


def topk_channels(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` channels each group keeps under the rule of the module notes: ``values``
    ``[..., c]`` (a floating tensor; the last dimension is one group's channels) -> ``[..., k]``
    ``int64`` channel indices in ``[0, c)``, ranked (largest value first, ties by the lower index).
    The choice is a constant: no gradient flows through it."""
    values = values.detach()
    c = values.shape[-1]
    if not 0 < k <= c:
        raise ValueError(f"keeping {k} of {c} channels")
    key_types = _KEY_TYPES.get(values.element_size())
    if key_types is None or (values.element_size() == 2 and c > 1 << 16):
        # [..., c] -> [..., k]; "+ 0.0" makes -0.0 equal to +0.0 for every sort implementation
        return torch.sort(values + 0.0, dim=-1, descending=True, stable=True).indices[..., :k].contiguous()
    bits, key_type = key_types
    sign = 8 * values.element_size() - 1
    key = values.view(bits).to(key_type)  # [..., c], sign-extended
    key ^= (key >> sign) & ((1 << sign) - 1)  # negative values: magnitude bits flipped, so the integers order as the values
    key += key < 0  # -0.0 (now -1) onto +0.0 (0), every other negative value one up: the order is kept
    key *= c
    key += torch.arange(c - 1, -1, -1, dtype=key_type, device=key.device)  # the lower index, the larger key
    return key.topk(k, dim=-1, sorted=True).indices  # [..., k]
