"""What a setting of ``N`` steps at every switch of a sharing schedule is, whatever the steps do
(the learning-rate re-warm after each switch, :mod:`.rewarm`; the blended switch before it,
:mod:`.ramp`): on with ``N > 0`` and EPAS on, stored in the checkpoint as ``{"steps": N}``, and a
resume with another ``N`` refused (the rest of the run would not continue the same trajectory)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.schedule import SharingSchedule


@dataclass(frozen=True)
class StepsPerSwitch:
    """``N`` steps at every switch of ``schedule`` (a subclass says which steps, and checks ``N``)."""

    flag: ClassVar[str]
    """The command-line flag that sets ``N``."""

    schedule: SharingSchedule
    """The switches."""

    steps: int
    """``N`` (0: off)."""

    @property
    def enabled(self) -> bool:
        """Whether any step differs from the run without the flag."""
        return self.steps > 0 and self.schedule.enabled

    def state_dict(self) -> dict[str, int]:
        """Its checkpoint-metadata entry (the schedule is stored on its own)."""
        return {"steps": self.steps}

    def check_resume(self, saved: Optional[Mapping[str, int]], iteration: int) -> None:
        """Refuse a checkpoint trained with another ``N`` (``saved`` None: without the flag)."""
        saved_steps = 0 if saved is None else saved.get("steps")
        if saved_steps != self.steps:
            raise ConfigError(f"--load: the checkpoint at iteration {iteration} was trained with {self.flag} {saved_steps}, "
                              f"this run has {self.flag} {self.steps}; resume with {self.flag} {saved_steps} (or start from "
                              "its weights with --pretrained)")
