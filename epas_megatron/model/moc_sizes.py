"""Mixture-of-Channels as a value (:class:`MoCSettings`, :mod:`epas_megatron.model.moc`) and its
sizes, pure arithmetic: how many channels a token keeps per group, the index width, and what a
token keeps for backward -- carried from the config to the layer, the memory model, conversion
and reporting without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from epas_megatron.errors import ConfigError


@dataclass(frozen=True)
class MoCSettings:
    """The Mixture-of-Channels MLPs of a model (None where the MLPs are dense)."""

    topk: float
    """Kept fraction of the SwiGLU channels, in (0, 1) (``--moc-topk``)."""

    groups: int = 8
    """Channel groups, each keeping its own Top-K (``--moc-groups``)."""

    @staticmethod
    def from_flags(topk: float, groups: int) -> Optional["MoCSettings"]:
        """``--moc-topk`` / ``--moc-groups`` as a value: None for the dense MLP (``topk`` 1);
        ``ConfigError`` for a fraction outside (0, 1]."""
        if not 0.0 < topk <= 1.0:
            raise ConfigError(f"--moc-topk must be in (0, 1] (the kept fraction of the SwiGLU channels), got {topk}")
        return None if topk == 1.0 else MoCSettings(topk, groups)

    def check(self, ffn_hidden_size: int, tp: int, backend: str) -> None:
        """``ConfigError`` naming the flag, before any work, for a model these MLPs cannot run in."""
        if self.groups < 1 or ffn_hidden_size % self.groups:
            raise ConfigError(f"--moc-groups {self.groups} must divide --ffn-hidden-size {ffn_hidden_size}")
        if self.groups % tp:
            raise ConfigError(f"--moc-groups {self.groups} must be a multiple of --tp {tp} (a group may not straddle a "
                              "tensor-parallel shard)")
        if backend != "local":
            raise ConfigError("--moc-topk < 1 is built for the local layers: use --transformer-impl local (or --moc-topk 1)")

    def kept(self, ffn_hidden_size: int) -> int:
        """Channels kept per token in each group (:func:`kept_channels`)."""
        return kept_channels(ffn_hidden_size, self.groups, self.topk)


def check_moc_config(topk: float, groups: int, ffn_hidden_size: int, tp: int, backend: str) -> None:
    """The ``--moc-topk`` / ``--moc-groups`` flags checked against the model (nothing to check for
    the dense MLP)."""
    settings = MoCSettings.from_flags(topk, groups)
    if settings is not None:
        settings.check(ffn_hidden_size, tp, backend)


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
