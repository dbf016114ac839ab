"""Mixture-of-Channels as a value and a build option (:class:`MoCSettings`, :mod:`epas_megatron.model.moc`)
and its sizes, pure arithmetic: how many channels a token keeps per group, the index width, and
what a token keeps for backward -- carried from the config to the layer, the memory model,
conversion and reporting without importing torch.

As a :class:`~epas_megatron.build_option.BuildOption` it checks its flags (``--moc-topk``,
``--moc-groups``, in the model's config section: a checkpoint records them with the model), rides
on the build plan (``plan.option(MoCSettings)``) and puts :class:`~epas_megatron.model.moc.MoCMLP`
in every decoder layer's ``mlp`` slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

from epas_megatron.build_option import BuildFacts, BuildOption
from epas_megatron.config.schema import RunConfig
from epas_megatron.errors import ConfigError
from epas_megatron.model.moc_channels import index_bytes, kept_channels, moc_saved_bytes_per_token  # noqa: F401 -- re-exported


@dataclass(frozen=True)
class MoCSettings(BuildOption):
    """The Mixture-of-Channels MLPs of a model (None where the MLPs are dense)."""

    name: ClassVar[str] = "moc"
    flag: ClassVar[str] = "--moc-topk"

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

    @classmethod
    def check_config(cls, cfg: RunConfig, facts: BuildFacts) -> list[str]:
        m = cfg.model
        check_moc_config(m.moc_topk, m.moc_groups, m.ffn_hidden_size, facts.tp, facts.backend)
        return []

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Optional["MoCSettings"]:
        return cls.from_flags(cfg.model.moc_topk, cfg.model.moc_groups)

    def layer_spec(self, spec: Any, mode: Any, backend: str) -> Any:
        """The layer's ``mlp`` slot (Megatron's ``MLP.as_mlp_submodule`` with the backend's linears)
        becomes :class:`~epas_megatron.model.moc.MoCMLP`'s, with the same linears."""
        from epas_megatron.model.moc import MoCMLP  # torch and Megatron-Core's MLP: seconds that epas-plan never needs

        if backend != "local":
            raise ValueError("Mixture-of-Channels MLPs are built for the local layers only")
        mlp_submodules = spec.submodules.mlp.keywords["submodules"]
        return replace(spec, submodules=replace(spec.submodules, mlp=MoCMLP.slot(mlp_submodules, self)))

    def kept(self, ffn_hidden_size: int) -> int:
        """Channels kept per token in each group (:func:`kept_channels`)."""
        return kept_channels(ffn_hidden_size, self.groups, self.topk)


def check_moc_config(topk: float, groups: int, ffn_hidden_size: int, tp: int, backend: str) -> None:
    """The ``--moc-topk`` / ``--moc-groups`` flags checked against the model (nothing to check for
    the dense MLP)."""
    settings = MoCSettings.from_flags(topk, groups)
    if settings is not None:
        settings.check(ffn_hidden_size, tp, backend)
