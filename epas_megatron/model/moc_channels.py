"""Mixture-of-Channels' channel arithmetic, pure: how many channels a token keeps per group, the
index width, and what a token keeps for backward -- shared by the MLP (:mod:`.moc`) and the
settings that describe it (:mod:`.moc_sizes`), which builds that MLP into the layer specs."""

from __future__ import annotations


def kept_channels(ffn_hidden_size: int, groups: int, topk: float) -> int:
    """Channels kept per token in each group: ``round(topk * ffn / groups)``, at least 1."""
    per_group = ffn_hidden_size // groups
    return max(1, min(per_group, round(topk * per_group)))


def index_bytes(per_group: int) -> int:
    """Bytes of the narrowest integer type that holds a channel's index within its group
    (uint8, int16, int32)."""
    return 1 if per_group <= 256 else 2 if per_group <= 32768 else 4


def moc_saved_bytes_per_token(ffn_local: int, groups_local: int, topk: float, value_bytes: int) -> int:
    """Bytes one token keeps for backward in a MoC activation + ``linear_fc2`` (one TP rank):
    ``k`` indices and ``k`` values of ``G`` and of ``U`` per group. (``linear_fc1``'s input is
    kept by ``linear_fc1``, as in the dense MLP.)"""
    per_group = ffn_local // groups_local
    k = kept_channels(ffn_local, groups_local, topk)
    return groups_local * k * (2 * value_bytes + index_bytes(per_group))
