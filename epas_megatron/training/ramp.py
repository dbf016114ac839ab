"""``--epas-switch-ramp`` as a training feature (:class:`~epas_megatron.training.features.TrainingFeature`):
the blended switch.

Which layers blend, and by how much, is :mod:`epas_megatron.sharing.ramp`'s (a pure function of
the iteration and the sharing schedule). This object applies it to the built model before every
step (``before_step``): inside a ramp, the blending layers and the sources the switch will make
hand Q/K (K/V) on, and the blending layers get their weight ``a``; outside, every layer is as its
spec built it. Nothing else changes -- no parameters, no optimizer state, no rebuild: the layers
of a ramp are computing layers (built able to blend by the ramp's build option,
:mod:`epas_megatron.model.blending`), and the switch at the end of it is the ordinary one. It also
says so in the start-up banner, records ``a`` in the metrics, and stores ``N`` in the checkpoint
metadata so that a resume with another value is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

from epas_megatron.errors import ConfigError
from epas_megatron.model.blending import BlendingAttention
from epas_megatron.runtime.wrapping import unwrap_model
from epas_megatron.sharing.ramp import SwitchRamp
from epas_megatron.training.features import TrainingFeature
from epas_megatron.validation import ResolvedRun


def apply_ramp(model: Sequence, ramp: SwitchRamp, iteration: int, share: str) -> None:
    """Set every decoder layer of the chunks ``model`` for the step of ``iteration`` (1-based)."""
    step = ramp.step(iteration)
    weights = {layer: step.weight for layer in step.blending} if step is not None else {}
    hands_off = set(step.hand_off) if step is not None else set()
    for chunk in model:
        for layer in unwrap_model(chunk).decoder.layers:
            attention, index = layer.self_attention, layer.layer_number - 1
            if not isinstance(attention, BlendingAttention):  # a sharing layer (the option builds every other)
                continue
            attention.hand_off = share if index in hands_off else attention.built_hand_off
            attention.blend = weights.get(index)


@dataclass(frozen=True)
class SwitchRampFeature(TrainingFeature):
    """``--epas-switch-ramp N`` (N > 0 with EPAS on): each switch's layers blend onto their source first."""

    name: ClassVar[str] = "epas_switch_ramp"
    flag: ClassVar[str] = "--epas-switch-ramp"
    resume_flags: ClassVar[str] = "--epas-switch-ramp value"

    ramp: SwitchRamp
    """The ramps of the run's schedule."""

    share: str
    """What sharing layers reuse ('qk' or 'kv')."""

    @classmethod
    def check_config(cls, run: ResolvedRun) -> list[str]:
        steps = run.cfg.epas.epas_switch_ramp
        SwitchRamp(run.schedule, steps)  # --epas-switch-ramp: >= 0, < --epas-interval and < --epas-first-switch
        if steps and not run.schedule.enabled:
            return [f"--epas-switch-ramp {steps} has no effect: EPAS is off (--epas-target-layers 0)"]
        if steps and run.cfg.parallel.pp > 1:
            raise ConfigError(f"--epas-switch-ramp {steps} needs --pp 1 (a ramp's hand-off would cross pipeline "
                              f"stages that the region does not cross yet); use --pp 1 or drop --epas-switch-ramp")
        if steps and run.cfg.random_ltd.random_ltd:
            raise ConfigError(f"--epas-switch-ramp {steps} is not supported with --random-ltd yet; drop one of them")
        return []

    @classmethod
    def from_run(cls, run: ResolvedRun) -> Optional["SwitchRampFeature"]:
        ramp = SwitchRamp(run.schedule, run.cfg.epas.epas_switch_ramp)
        return cls(ramp, run.cfg.epas.epas_share) if ramp.enabled else None

    def check_resume(self, saved: Optional[dict], iteration: int) -> None:
        self.ramp.check_resume(saved, iteration)

    def describe(self, train_iters: int) -> str:
        return self.ramp.describe()

    def before_step(self, model: Sequence, step: int) -> None:
        apply_ramp(model, self.ramp, step + 1, self.share)

    def record(self, iteration: int) -> dict[str, Any]:
        """``a`` of the step of ``iteration`` (0 outside a ramp)."""
        step = self.ramp.step(iteration) if iteration >= 1 else None
        return {"switch_ramp_weight": step.weight if step is not None else 0.0}

    def state_dict(self, iteration: int) -> dict:
        return self.ramp.state_dict()
