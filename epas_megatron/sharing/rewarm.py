"""The learning-rate re-warm after each EPAS switch (``--epas-switch-rewarm N``), as pure functions.

A switch changes the network at once (the switching layers drop their own Q/K for the source's),
and the validation loss jumps right after it before it recovers. The re-warm lowers the learning
rate for the ``N`` steps that start at every switch and raises it linearly back to the
scheduler's value, as a warm-up would after a fresh start.

**The ramp.** For a switch at iteration ``t`` (1-based, the switch happens before the step of
``t``; :mod:`.schedule`), the step of iteration ``t + k`` runs with the learning rate of the
scheduler (Megatron's warm-up and decay, in whatever units it is stepped) times

    factor(t + k) = (k + 1) / (N + 1)        for k = 0, 1, ..., N - 1,

and every other step with factor 1: ``1/(N+1), 2/(N+1), ..., N/(N+1)``, then ``(N+1)/(N+1) = 1``
at ``t + N`` -- the line from 0 (just before the switch, never used) to the scheduler's LR, one
step of it per iteration. ``N = 0`` is off (every factor 1). ``N < interval``, so the windows of
two switches never overlap and every window ends before the next switch.

The factor depends on the iteration and the schedule only, so a run stopped and resumed anywhere
(inside a window too) continues with the factors of the uninterrupted run. It changes no FLOPs:
the same steps run on the same tokens, only the optimizer's step size differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.per_switch import StepsPerSwitch
from epas_megatron.sharing.schedule import SharingSchedule

__all__ = ["SwitchRewarm", "rewarm_factor"]

FLAG = "--epas-switch-rewarm"


def _check_steps(steps: object, schedule: SharingSchedule) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ConfigError(f"{FLAG} must be an integer >= 0 (iterations of re-warm after each switch; 0: off), got {steps!r}")
    if steps and steps >= schedule.interval:
        raise ConfigError(f"{FLAG} {steps} must be smaller than --epas-interval {schedule.interval}: the re-warm after a "
                          f"switch must end before the next switch; use at most {schedule.interval - 1}")


def rewarm_factor(iteration: int, schedule: SharingSchedule, steps: int) -> float:
    """The factor on the scheduler's LR for the step of ``iteration`` (1-based):
    ``(k + 1) / (steps + 1)`` when ``iteration = t + k`` for a switch iteration ``t`` of
    ``schedule`` and ``0 <= k < steps``, else 1.0 (also with EPAS off or ``steps = 0``)."""
    _check_steps(steps, schedule)
    if not isinstance(iteration, int) or iteration < 1:
        raise ValueError(f"iteration must be an integer >= 1 (the step's 1-based iteration), got {iteration!r}")
    offset = iteration - schedule.first_switch
    if not steps or not schedule.enabled or offset < 0 or offset // schedule.interval >= schedule.num_switches:
        return 1.0
    k = offset % schedule.interval  # steps since the last switch (that switch's step is k = 0)
    return (k + 1) / (steps + 1) if k < steps else 1.0


@dataclass(frozen=True)
class SwitchRewarm(StepsPerSwitch):
    """``--epas-switch-rewarm``: the re-warm windows of one sharing schedule."""

    flag: ClassVar[str] = FLAG

    def __post_init__(self) -> None:
        _check_steps(self.steps, self.schedule)

    def factor(self, iteration: int) -> float:
        """:func:`rewarm_factor` of ``iteration`` (1-based)."""
        return rewarm_factor(iteration, self.schedule, self.steps)

    def windows(self) -> list[tuple[int, int]]:
        """``(first, last)`` re-warmed iteration of each switch (empty when off)."""
        if not self.enabled:
            return []
        return [(t, t + self.steps - 1) for t, _ in self.schedule.switch_iterations()]

    def describe(self) -> str:
        """One line for the start-up banner."""
        n = self.steps
        windows = ", ".join(f"{a}-{b}" for a, b in self.windows())
        return (f"LR re-warm after each switch ({FLAG} {n}): the scheduler's LR x (k+1)/{n + 1} at iteration t+k, "
                f"k = 0..{n - 1}, for every switch t (iterations {windows}); no FLOPs change")
