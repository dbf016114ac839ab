"""The switch ramp's model side (``--epas-switch-ramp``, :mod:`epas_megatron.sharing.ramp`) as a
build option: every computing layer is built as a :class:`BlendingAttention`, which can blend its
post-RoPE Q/K (K/V) toward the hand-off entering it before it attends and hands them on.

A layer about to switch blends, in the ramp's steps before its switch, ``(1 - a)`` times its own
pair plus ``a`` times the incoming hand-off (:attr:`BlendingAttention.blend`); a layer the switch
will make a source hands on during the ramp (:attr:`~epas_megatron.model.attention.ComputingAttention.hand_off`
set, :attr:`BlendingAttention.built_hand_off` restores it). Both are set before each step by the
training feature (:mod:`epas_megatron.training.ramp`), from the ramp's pure schedule. A run
without the ramp builds Megatron-Core's ``SelfAttention`` sibling as always
(:class:`~epas_megatron.model.attention.ComputingAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Optional

from torch import Tensor

from epas_megatron.build_option import BuildOption
from epas_megatron.config.schema import RunConfig
from epas_megatron.model.attention import ComputingAttention
from epas_megatron.sharing.schedule import SharingSchedule
from epas_megatron.sharing.shape import LayerMode


class BlendingAttention(ComputingAttention):
    """A computing layer's attention that can blend its Q/K (K/V) toward the incoming hand-off."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built_hand_off = self.hand_off
        """:attr:`hand_off` as the spec built it (a ramp sets and restores the other)."""
        self.blend: Optional[float] = None
        """While a switch ramps in: the incoming hand-off's weight ``a`` in this layer's Q/K (K/V);
        None: its own only."""

    def before_hand_off(self, query: Tensor, key: Tensor, value: Tensor,
                        incoming: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        if self.blend is None:
            return query, key, value
        if incoming is None:
            raise RuntimeError(f"layer {self.layer_number} blends toward its source's Q/K (--epas-switch-ramp) "
                               "but received no hand-off")
        first, second = (t.detach() for t in incoming) if self.detach_shared else incoming
        a = self.blend
        # (1 - a) own + a incoming, elementwise [s, b, heads, hn]; at a = 1 exactly the incoming pair.
        if self.hand_off == "qk":
            return (1 - a) * query + a * first, (1 - a) * key + a * second, value
        return query, (1 - a) * key + a * first, (1 - a) * value + a * second


@dataclass(frozen=True)
class SwitchRampSettings(BuildOption):
    """``--epas-switch-ramp N`` (N > 0): computing layers built to blend (its flag's checks and the
    per-step settings are the training feature's, :mod:`epas_megatron.training.ramp`)."""

    name: ClassVar[str] = "epas_switch_ramp"
    flag: ClassVar[str] = "--epas-switch-ramp"
    training_only: ClassVar[bool] = True

    steps: int
    """Iterations of blending before each switch."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Optional["SwitchRampSettings"]:
        steps = cfg.epas.epas_switch_ramp
        return cls(steps) if steps and SharingSchedule.from_config(cfg).enabled else None

    def layer_spec(self, spec: Any, mode: Any, backend: str) -> Any:
        if LayerMode(mode) == LayerMode.SHARE:
            return spec
        attention = replace(spec.submodules.self_attention, module=BlendingAttention)
        return replace(spec, submodules=replace(spec.submodules, self_attention=attention))
