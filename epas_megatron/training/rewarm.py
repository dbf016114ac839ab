"""``--epas-switch-rewarm`` as a training feature (:class:`~epas_megatron.training.features.TrainingFeature`):
the learning-rate re-warm after each EPAS switch.

What the factor is, is :mod:`epas_megatron.sharing.rewarm`'s (a pure function of the iteration and
the sharing schedule); this object hands it to the trainer through the ``lr_factor`` hook, which
:func:`epas_megatron.engine.step.train_step` applies to every parameter group on top of the
scheduler's LR (whatever units the scheduler counts: iterations, or Random-LTD's layer tokens). It
also says so in the start-up banner, records the factor of the logged ``lr`` in the metrics, and
stores ``N`` in the checkpoint metadata so that a resume with another value is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from epas_megatron.sharing.rewarm import SwitchRewarm
from epas_megatron.training.features import TrainingFeature
from epas_megatron.validation import ResolvedRun


@dataclass(frozen=True)
class SwitchRewarmFeature(TrainingFeature):
    """``--epas-switch-rewarm N`` (N > 0 with EPAS on): the LR ramps back up after each switch."""

    name: ClassVar[str] = "epas_switch_rewarm"
    flag: ClassVar[str] = "--epas-switch-rewarm"
    resume_flags: ClassVar[str] = "--epas-switch-rewarm value"

    rewarm: SwitchRewarm
    """The re-warm windows of the run's schedule."""

    @classmethod
    def check_config(cls, run: ResolvedRun) -> list[str]:
        steps = run.cfg.epas.epas_switch_rewarm
        SwitchRewarm(run.schedule, steps)  # --epas-switch-rewarm: >= 0 and < --epas-interval
        if steps and not run.schedule.enabled:
            return [f"--epas-switch-rewarm {steps} has no effect: EPAS is off (--epas-target-layers 0)"]
        return []

    @classmethod
    def from_run(cls, run: ResolvedRun) -> Optional["SwitchRewarmFeature"]:
        rewarm = SwitchRewarm(run.schedule, run.cfg.epas.epas_switch_rewarm)
        return cls(rewarm) if rewarm.enabled else None

    def check_resume(self, saved: Optional[dict], iteration: int) -> None:
        self.rewarm.check_resume(saved, iteration)

    def describe(self, train_iters: int) -> str:
        return self.rewarm.describe()

    def lr_factor(self, iteration: int) -> float:
        return self.rewarm.factor(iteration)

    def record(self, iteration: int) -> dict[str, Any]:
        """The factor in the ``lr`` logged after ``iteration``: the next step's."""
        return {"lr_rewarm_factor": self.rewarm.factor(iteration + 1)}

    def state_dict(self, iteration: int) -> dict:
        return self.rewarm.state_dict()
