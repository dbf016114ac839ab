"""The blended switch (``--epas-switch-ramp N``), as pure functions: the layers of a switch move
onto their source's Q/K over the ``N`` steps before it, instead of all at once.

A switch replaces a layer's own post-RoPE Q and K by its source's at once, and the validation
loss jumps right after it. The ramp spreads that change over the ``N`` iterations before each
switch. For a switch at iteration ``t`` (1-based; the region grows before the step of ``t``,
:mod:`.schedule`), the step of iteration ``t - k`` (``k = N, ..., 1``) runs every layer that
switches at ``t`` -- a *blending* layer, still computing its own Q/K -- with

    Q = (1 - a) Q_own + a Q_in,   K = (1 - a) K_own + a K_in,   a(t - k) = (N - k + 1) / N

(K and V for ``--epas-share kv``), where ``(Q_in, K_in)`` is the hand-off entering the layer:
the source's after the switch for the shallowest blending layer, the blended pair of the layer
before it for the others. Each blending layer hands its blended pair on, so the layers that
already share (they read the last blending layer, their source before the switch) see the same
continuous change: ``a = 1/N, 2/N, ..., 1``. At ``a = 1`` (the step of ``t - 1``) every
blending layer attends with its future source's Q/K exactly, so the switch itself changes the
forward pass by nothing; from ``t`` on the layers share as always (own Q/K frozen).

Costs: no FLOPs beyond two multiply-adds per Q/K element of a blending layer, since the ramp
runs while the layers still compute their own Q/K; the switches happen at the schedule's
iterations, so the region's savings start when they would without the ramp. The own Q/K
projections still train during the ramp (their gradient scaled by ``1 - a``).

``N`` must be smaller than ``--epas-interval`` (two ramps never overlap, a ramp never contains
a switch) and at most ``--epas-first-switch - 1`` (the first ramp starts at iteration 1 or
later). The weights depend on the iteration and the schedule only, so a run resumed inside a
ramp continues it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.per_switch import StepsPerSwitch
from epas_megatron.sharing.schedule import SharingSchedule
from epas_megatron.sharing.shape import LayerMode

__all__ = ["RampStep", "SwitchRamp", "ramp_step"]

FLAG = "--epas-switch-ramp"


def _check_steps(steps: object, schedule: SharingSchedule) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ConfigError(f"{FLAG} must be an integer >= 0 (iterations of blending before each switch; 0: off), got {steps!r}")
    if not steps or not schedule.enabled:
        return
    if steps >= schedule.interval:
        raise ConfigError(f"{FLAG} {steps} must be smaller than --epas-interval {schedule.interval}: a ramp must not "
                          f"contain the previous switch; use at most {schedule.interval - 1}")
    if steps >= schedule.first_switch:
        raise ConfigError(f"{FLAG} {steps} needs the first switch after iteration {steps} (the ramp runs the {steps} "
                          f"steps before each switch), but --epas-first-switch is {schedule.first_switch}; use "
                          f"{FLAG} {schedule.first_switch - 1} or less, or a later --epas-first-switch")


@dataclass(frozen=True)
class RampStep:
    """What the step of one iteration inside a ramp does differently."""

    switch: int
    """The iteration of the switch this ramp leads to."""

    weight: float
    """``a``: the incoming hand-off's weight in the blending layers' Q/K (K/V)."""

    blending: tuple[int, ...]
    """The layers that switch at :attr:`switch` (ascending): they blend their own Q/K with the
    incoming hand-off and hand the blend on."""

    hand_off: tuple[int, ...]
    """Every layer that hands Q/K on in this step beyond those the region already has: the
    blending layers and the sources the switch makes (ascending)."""


def ramp_step(iteration: int, schedule: SharingSchedule, steps: int) -> Optional[RampStep]:
    """The ramp of the step of ``iteration`` (1-based), or None outside every ramp (also with
    EPAS off or ``steps = 0``)."""
    _check_steps(steps, schedule)
    if not isinstance(iteration, int) or iteration < 1:
        raise ValueError(f"iteration must be an integer >= 1 (the step's 1-based iteration), got {iteration!r}")
    if not steps or not schedule.enabled:
        return None
    switch = schedule.next_switch(iteration)
    if switch is None or switch - iteration > steps:
        return None
    k = switch - iteration  # 1..steps: steps left before the switch
    before, after = schedule.layer_modes(switch - 1), schedule.layer_modes(switch)
    blending = tuple(i for i, (b, a) in enumerate(zip(before, after)) if a == LayerMode.SHARE and b != LayerMode.SHARE)
    new_sources = tuple(i for i, (b, a) in enumerate(zip(before, after)) if a == LayerMode.SOURCE and b == LayerMode.COMPUTE)
    return RampStep(switch=switch, weight=(steps - k + 1) / steps, blending=blending,
                    hand_off=tuple(sorted(set(blending) | set(new_sources))))


@dataclass(frozen=True)
class SwitchRamp(StepsPerSwitch):
    """``--epas-switch-ramp``: the ramps of one sharing schedule."""

    flag: ClassVar[str] = FLAG

    def __post_init__(self) -> None:
        _check_steps(self.steps, self.schedule)

    def step(self, iteration: int) -> Optional[RampStep]:
        """:func:`ramp_step` of ``iteration`` (1-based)."""
        return ramp_step(iteration, self.schedule, self.steps)

    def windows(self) -> list[tuple[int, int]]:
        """``(first, last)`` blended iteration before each switch (empty when off)."""
        if not self.enabled:
            return []
        return [(t - self.steps, t - 1) for t, _ in self.schedule.switch_iterations()]

    def describe(self) -> str:
        """One line for the start-up banner."""
        n = self.steps
        windows = ", ".join(f"{a}-{b}" for a, b in self.windows())
        return (f"blended switches ({FLAG} {n}): the layers of each switch t attend with (1-a) own + a source Q/K, "
                f"a = 1/{n} .. 1 over iterations t-{n}..t-1 (iterations {windows}); two multiply-adds per blended "
                f"Q/K element, the switches at their iterations")
