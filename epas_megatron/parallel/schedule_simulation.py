"""Pipeline schedules simulated: each rank runs its action list
(:mod:`epas_megatron.parallel.pipeline_schedule`) in order, each action as soon as the one before
it on its rank and the one it depends on have ended -- with any ``F``/``B``/``W`` costs, the same
for every stage or each stage its own. Gives the execution times, the bubble and each rank's peak
activations: in chunk passes, or in bytes with each stage's pass weighed by what it holds before
and after its ``B`` (:func:`rank_peak_bytes` counts the same along one rank's list: the order
fixes it). Nothing here touches a process or a tensor: the memory model, ``epas-plan`` and the
schedule benchmark price schedules with it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from epas_megatron.parallel.pipeline_schedule import Action, ScheduleActions, build_schedule, depends_on


@dataclass(frozen=True)
class PassCosts:
    """Seconds (or any unit) of one pass of one micro-batch through a whole rank's layers (a V
    schedule's stage is half of them: :func:`simulate` halves the costs there, so schedules on the
    same model compare at the same work per rank)."""

    forward: float = 1.0
    input_grad: float = 1.0
    """``B``."""

    weight_grad: float = 1.0
    """``W``; a whole backward (``BW``) costs ``B + W``."""

    p2p: float = 0.0
    """Between a send's end of pass and the receiver's start (each stage boundary crossed)."""

    def of(self, kind: str) -> float:
        return {"F": self.forward, "B": self.input_grad, "W": self.weight_grad,
                "BW": self.input_grad + self.weight_grad}[kind]


@dataclass
class Simulation:
    """The schedule run in order with :class:`PassCosts` (see :func:`simulate`)."""

    start: dict = field(default_factory=dict)
    """Action -> start time."""

    end: dict = field(default_factory=dict)
    """Action -> end time."""

    busy: list = field(default_factory=list)
    """Per rank: total compute time."""

    span: list = field(default_factory=list)
    """Per rank: from its first action's start to its last action's end."""

    peak_chunks: list = field(default_factory=list)
    """Per rank: the most chunk-passes whose activations it held at once (held from a forward's
    start to the end of its ``W``, or of its ``BW``)."""

    chunks_per_rank: int = 1

    peak_bytes: list = field(default_factory=list)
    """Per rank, with ``stage_bytes`` given: the most bytes held at once, each pass weighed by
    what it holds in each phase (see :func:`simulate`); else empty."""

    @property
    def makespan(self) -> float:
        return max(self.end.values())

    @property
    def bubble(self) -> float:
        """Idle share of the longest rank: ``1 - busy / span`` (the paper's bubble rate)."""
        rank = max(range(len(self.span)), key=lambda r: self.span[r])
        return 1.0 - self.busy[rank] / self.span[rank]

    @property
    def bubble_time(self) -> float:
        """Idle time of the longest rank."""
        return max(self.span) - self.busy[max(range(len(self.span)), key=lambda r: self.span[r])]

    @property
    def peak_in_flight(self) -> list[float]:
        """Per rank: the peak in micro-batches of the whole rank's layers (``peak_chunks`` over
        the chunks per rank) -- what the memory model multiplies a micro-batch's activations by."""
        return [c / self.chunks_per_rank for c in self.peak_chunks]


def simulate(schedule: ScheduleActions, costs: PassCosts = PassCosts(),
             stage_bytes: Optional[Mapping[int, tuple[float, float]]] = None,
             stage_costs: Optional[Mapping[int, PassCosts]] = None,
             action_seconds: Optional[Callable[[Action], float]] = None) -> Simulation:
    """Run every rank's list in order, each action as soon as the action before it on its rank
    and the one it depends on (plus ``costs.p2p`` when that one is on another rank) have ended.
    ``ValueError`` if the lists deadlock (an action waits for one that can never run).

    ``stage_costs``: each virtual stage's own costs (stages of unequal work: an uneven layout,
    the LM head's stage), used as given -- not halved under V placement; ``costs`` then gives
    only the p2p time. ``action_seconds``: each action's own cost (an executed timeline replayed:
    ``epas-bench pipeline``), before either.

    ``stage_bytes``: per virtual stage, ``(full, deferred)`` -- what one pass of that stage holds
    from its ``F``'s start to the end of its ``B`` (its activations), and from there to the end of
    its ``W`` (what the deferred weight-gradient GEMMs keep: the linears' inputs and output
    gradients); a ``BW`` holds ``full`` to its end. Gives :attr:`Simulation.peak_bytes`; stages
    left out hold nothing."""
    sim = Simulation(chunks_per_rank=schedule.chunks_per_rank)

    def cost(action: Action) -> float:
        if action_seconds is not None:
            return action_seconds(action)
        if stage_costs is not None:
            return stage_costs[action.stage].of(action.kind)
        return costs.of(action.kind) / schedule.chunks_per_rank

    position = [0] * schedule.pp
    free = [0.0] * schedule.pp
    remaining = sum(len(actions) for actions in schedule.ranks)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.ranks):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needed = depends_on(schedule, action)
                ready = free[rank]
                if needed is not None:
                    if needed not in sim.end:
                        break
                    crossing = schedule.rank_of(needed.stage) != rank
                    ready = max(ready, sim.end[needed] + (costs.p2p if crossing else 0.0))
                sim.start[action] = ready
                sim.end[action] = free[rank] = ready + cost(action)
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(actions[position[r]]) for r, actions in enumerate(schedule.ranks) if position[r] < len(actions)]
            raise ValueError(f"{schedule.name}: the action lists deadlock (waiting: {', '.join(stuck)})")
    for rank, actions in enumerate(schedule.ranks):
        sim.busy.append(sum(cost(a) for a in actions))
        sim.span.append(sim.end[actions[-1]] - sim.start[actions[0]])
        releases = ("W", "BW")
        events = sorted([(sim.start[a], 1) for a in actions if a.kind == "F"] +
                        [(sim.end[a], -1) for a in actions if a.kind in releases])
        held = peak = 0
        for _, change in events:  # a release at the same time as a forward's start comes first
            held += change
            peak = max(peak, held)
        sim.peak_chunks.append(peak)
        if stage_bytes is not None:
            weighed = []
            for a in actions:
                full, deferred = stage_bytes.get(a.stage, (0.0, 0.0))
                if a.kind == "F":
                    weighed.append((sim.start[a], full))
                elif a.kind == "B":
                    weighed.append((sim.end[a], deferred - full))
                elif a.kind in releases:
                    weighed.append((sim.end[a], -(deferred if a.kind == "W" else full)))
            held = peak_bytes = 0.0
            for _, change in sorted(weighed):  # (a release, negative, first at a tie)
                held += change
                peak_bytes = max(peak_bytes, held)
            sim.peak_bytes.append(peak_bytes)
    return sim


def rank_peak_bytes(schedule: ScheduleActions, rank: int, stage_bytes: Mapping[int, tuple[float, float]]) -> float:
    """:attr:`Simulation.peak_bytes` of one rank without simulating the others: a rank runs its
    list one action at a time, so its peak is fixed by the order alone (whatever the costs) --
    a forward adds its stage's ``full``, a ``B`` gives back all but ``deferred``, a ``W`` the
    ``deferred``, a ``BW`` the ``full`` (``stage_bytes`` as in :func:`simulate`)."""
    held = peak = 0.0
    for action in schedule.ranks[rank]:
        full, deferred = stage_bytes.get(action.stage, (0.0, 0.0))
        held += {"F": full, "B": deferred - full, "W": -deferred, "BW": -full}[action.kind]
        peak = max(peak, held)
    return peak


@functools.lru_cache(maxsize=64)
def peak_in_flight(name: str, pp: int, microbatches: int) -> tuple[float, ...]:
    """:attr:`Simulation.peak_in_flight` of schedule ``name`` (every pass alike, held whole to the
    end of its ``W`` or ``BW``), per rank; made once per arguments."""
    return tuple(simulate(build_schedule(name, pp, microbatches)).peak_in_flight)
