"""Pipeline schedules as data: per-rank action lists, their placement, and their simulation.

Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024) describe a schedule as
one *building block* -- when each pass of one micro-batch runs on each stage -- repeated for every
micro-batch at a fixed interval; the block's lifespans fix the peak activation memory. This module
builds the schedules of that family that this project runs, as pure functions of the pipeline size
``p`` and the micro-batch count ``m``:

* ``1f1b``: Megatron-Core's one-forward-one-backward order on ``p`` stages, stage ``s`` on rank
  ``s``; rank ``r`` keeps ``p - r`` micro-batches in flight.
* ``v-1f1b``, ``v-half``, ``v-min``: **V placement** -- ``2p`` virtual stages, rank ``r`` holds
  stages ``r`` (its chunk 0) and ``2p-1-r`` (chunk 1), so a forward pass goes down the ranks and
  back up, turning on rank ``p-1`` without a send, and embedding, LM head and loss are on rank 0.

Every V schedule here is a building block with interval 6 (a rank's work per micro-batch: two
chunks' forward, input-gradient backward and weight-gradient backward at unit cost). Its start
times were derived for this project (closed forms below; the residues modulo 6 of a rank's
passes are distinct, so blocks of successive micro-batches never collide, and each pass starts
after the one it depends on). With ``F = B = W = 1``:

Searched over small offsets of these shapes by simulation (``p`` from 2 to 8, for v-1f1b to 16;
``m`` from ``p`` to ``4p``), picked for the paper's peak, then the least bubble:

* ``v-min``: F on stage ``s`` at ``s`` (the tightest forward), then the tightest backward chain:
  ``B`` of chunk 1 on rank ``r`` at ``2p + d + r``, of chunk 0 at ``4p + d - 1 - r`` (``d = 2``
  where ``p`` is a multiple of 3, else 0, to keep the residues apart). Peak ``(p + 4) // 3``
  micro-batches of a rank's layers.
* ``v-half``: forwards of chunk 0 two apart (``2r``), chunk 1 at ``f - r``, backward of chunk 1
  at ``f + 1 + 2r`` and of chunk 0 at ``b - r``, with ``(f, b) = (3p + 1, 6p + 4)`` for even
  ``p`` and ``(3p - 1, 6p - 2)`` for odd. Peak ``(p + 2) // 2``.
* ``v-1f1b``: no backward split (``BW`` = B and W together, cost 2, so its passes overlap later
  blocks' slots; a forward goes first on a tie): F of chunk 0 at ``r``, of chunk 1 at
  ``2p - 1 + f - r``, ``BW`` of chunk 1 at ``2p + f + b + 3r`` and of chunk 0 at
  ``8p - 3 + f + b - 3r``, with ``(f, b) = (0, 0), (0, 1), (2, 0)`` for ``p mod 3 = 1, 2, 0``.
  Peak three quarters of 1F1B's ``p``, rounded up to half a micro-batch (3 at ``p = 4``, 6 at
  8), with 1F1B's bubble (within 5 %), for ``p >= 3``; at ``p = 2`` it keeps 1F1B's 2.

``v-half`` and ``v-min`` split the backward pass: ``B`` (input gradient, what the previous stage
waits for) and ``W`` (the weight gradients, deferred); a ``W`` goes into the first free slot after
its ``B`` (first come, first served), and the activations of a pass are held from its ``F`` to the
end of its ``W`` (to the end of ``BW`` without the split).

A schedule is a list of compute actions per rank (:class:`Action`); :func:`with_p2p` adds the
sends and receives a runtime needs, and :func:`simulate` runs the lists in order with any
``F``/``B``/``W`` costs, the same for every stage or each stage its own (each action as soon
as the one before it on its rank and the one it depends on have ended): the execution times,
the bubble and each rank's peak activations -- in chunk passes, or in bytes with each stage's
pass weighed by what it holds before and after its ``B`` (:func:`rank_peak_bytes` counts the
same along one rank's list: the order fixes it). :func:`channel_orders` says whether every rank
pair's messages are received in the order they are sent (1F1B, V-Half and V-Min: yes; v-1f1b:
no, so its runtime must post receives in the senders' order). Nothing here touches a process or
a tensor: the executor (``engine/pipeline_executor.py``) runs the lists, the memory model and
``epas-plan`` price them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping, Optional

from epas_megatron.errors import ConfigError
from epas_megatron.model.v_placement import v_chunk, v_rank

SCHEDULES = ("1f1b", "interleaved", "v-1f1b", "v-half", "v-min")
"""``--pipeline-schedule`` values: Megatron-Core's two, and the V schedules of this module."""

V_SCHEDULES = ("v-1f1b", "v-half", "v-min")
"""The schedules with V placement."""

SPLIT_BACKWARD = ("v-half", "v-min")
"""The schedules that run the weight-gradient backward apart from the input-gradient one."""

BLOCK_INTERVAL = 6
"""A rank's work per micro-batch in a V building block, in unit passes."""

COMPUTE = ("F", "B", "W", "BW")
"""Compute actions: forward, input-gradient backward, weight-gradient backward, whole backward."""

P2P = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
"""Communication actions: activations forward, gradients backward."""


@dataclass(frozen=True)
class Action:
    """One action of one rank: ``kind`` on virtual ``stage`` for ``microbatch`` (a send or
    receive also names its ``peer`` rank)."""

    kind: str
    stage: int
    microbatch: int
    peer: Optional[int] = None

    def __str__(self) -> str:
        peer = f"->{self.peer}" if self.kind.startswith("SEND") else f"<-{self.peer}" if self.peer is not None else ""
        return f"{self.kind}{self.stage}.{self.microbatch}{peer}"


@dataclass(frozen=True)
class PipelineSchedule:
    """The per-rank action lists of one schedule for ``pp`` ranks and ``microbatches``."""

    name: str
    """One of :data:`SCHEDULES` (not 'interleaved': Megatron-Core runs that one)."""

    pp: int
    """Pipeline ranks."""

    microbatches: int
    """Micro-batches per iteration."""

    ranks: tuple[tuple[Action, ...], ...]
    """Compute actions of each rank, in the order the rank runs them."""

    @property
    def v_placement(self) -> bool:
        return self.name in V_SCHEDULES

    @property
    def stages(self) -> int:
        """Virtual stages: ``2p`` under V placement, else ``p``."""
        return 2 * self.pp if self.v_placement else self.pp

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.v_placement else 1

    @property
    def split_backward(self) -> bool:
        return self.name in SPLIT_BACKWARD

    @functools.cached_property
    def p2p_lists(self) -> tuple[tuple[Action, ...], ...]:
        """:func:`with_p2p` of this schedule, made once (the executor reads it every step)."""
        return with_p2p(self)

    def rank_of(self, stage: int) -> int:
        return v_rank(stage, self.pp) if self.v_placement else stage

    def chunk_of(self, stage: int) -> int:
        return v_chunk(stage, self.pp) if self.v_placement else 0


def check_schedule_config(name: str, pp: int, microbatches: int, vpp: Optional[int] = None,
                          flag: str = "--pipeline-schedule") -> None:
    """Refusals before any work, naming the flag to change."""
    if name not in SCHEDULES:
        raise ConfigError(f"{flag} {name!r}: choose one of {', '.join(SCHEDULES)}")
    if name in V_SCHEDULES:
        if pp < 2:
            raise ConfigError(f"{flag} {name} needs --pp >= 2 (a V schedule places two model chunks on each pipeline rank)")
        if vpp is not None and vpp > 1:
            raise ConfigError(f"{flag} {name} places two chunks per rank itself: drop --vpp {vpp} (or use {flag} interleaved)")
        if microbatches < pp:
            raise ConfigError(f"{flag} {name} with --pp {pp} needs at least {pp} micro-batches per iteration, got "
                              f"{microbatches}: raise --global-batch-size or lower --micro-batch-size")


@functools.lru_cache(maxsize=32)
def build_schedule(name: str, pp: int, microbatches: int) -> PipelineSchedule:
    """The per-rank compute actions of schedule ``name`` (see the module doc); made once per
    arguments (the trainer asks for it every step)."""
    check_schedule_config(name, pp, microbatches)
    if name == "interleaved":
        raise ConfigError("--pipeline-schedule interleaved is Megatron-Core's own schedule: it has no action lists here")
    if name == "1f1b":
        return PipelineSchedule(name, pp, microbatches, tuple(_one_f_one_b(pp, r, microbatches) for r in range(pp)))
    return PipelineSchedule(name, pp, microbatches, tuple(_from_block(name, pp, r, microbatches) for r in range(pp)))


def _one_f_one_b(pp: int, rank: int, m: int) -> tuple[Action, ...]:
    """Warm-up forwards (``p - r - 1``), then one forward and one backward in turn, then the
    remaining backwards -- Megatron-Core's ``forward_backward_pipelining_without_interleaving``."""
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", rank, i) for i in range(warmup)]
    forwards, backwards = warmup, 0
    while backwards < m:
        if forwards < m:
            actions.append(Action("F", rank, forwards))
            forwards += 1
        actions.append(Action("BW", rank, backwards))
        backwards += 1
    return tuple(actions)


def v_block(name: str, pp: int) -> dict[int, dict[tuple[str, int], int]]:
    """The building block of a V schedule: for each rank, the start time of each pass
    ``(kind, chunk)`` of micro-batch 0 at unit cost (without the ``W`` passes, placed by
    :func:`_from_block`)."""
    p = pp
    block = {}
    for r in range(p):
        if name == "v-min":
            d = 2 if p % 3 == 0 else 0
            block[r] = {("F", 0): r, ("F", 1): 2 * p - 1 - r, ("B", 1): 2 * p + d + r, ("B", 0): 4 * p + d - 1 - r}
        elif name == "v-half":
            f, b = (3 * p + 1, 6 * p + 4) if p % 2 == 0 else (3 * p - 1, 6 * p - 2)
            block[r] = {("F", 0): 2 * r, ("F", 1): f - r, ("B", 1): f + 1 + 2 * r, ("B", 0): b - r}
        elif name == "v-1f1b":
            f, b = {1: (0, 0), 2: (0, 1), 0: (2, 0)}[p % 3]
            block[r] = {("F", 0): r, ("F", 1): 2 * p - 1 + f - r, ("BW", 1): 2 * p + f + b + 3 * r,
                        ("BW", 0): 8 * p - 3 + f + b - 3 * r}
        else:
            raise ValueError(f"no building block for {name!r}")
    return block


def _from_block(name: str, pp: int, rank: int, m: int) -> tuple[Action, ...]:
    """Rank ``rank``'s actions: the block's passes for every micro-batch, ``BLOCK_INTERVAL``
    apart, in time order; with the split backward, each ``W`` in the first free slot after its
    ``B`` (first come, first served), the rest at the end."""
    timed = []
    for (kind, chunk), start in v_block(name, pp)[rank].items():
        stage = rank if chunk == 0 else 2 * pp - 1 - rank
        timed += [(start + BLOCK_INTERVAL * i, kind != "F", kind, stage, i) for i in range(m)]
    timed.sort()  # v-1f1b's whole backward passes overlap later blocks' slots: a forward goes first
    timed = [(t, kind, stage, i) for t, _, kind, stage, i in timed]
    if name not in SPLIT_BACKWARD:
        return tuple(Action(kind, stage, i) for _, kind, stage, i in timed)
    taken = {t for t, *_ in timed}
    actions, waiting, t, k = [], [], 0, 0
    while k < len(timed) or waiting:
        if k < len(timed) and timed[k][0] == t:
            _, kind, stage, i = timed[k]
            actions.append(Action(kind, stage, i))
            if kind == "B":
                waiting.append((stage, i))
            k += 1
        elif waiting and t not in taken:
            stage, i = waiting.pop(0)
            actions.append(Action("W", stage, i))
        t += 1
    return tuple(actions)


# ---------------------------------------------------------------------------- dependencies
def depends_on(schedule: PipelineSchedule, action: Action) -> Optional[Action]:
    """The action of another (or the same) stage that ``action`` waits for, or None: a forward
    waits for the previous stage's forward; a backward (``B`` or ``BW``) for the next stage's
    backward, the last stage's for its own forward; a ``W`` for its own stage's ``B``."""
    s, i, last = action.stage, action.microbatch, schedule.stages - 1
    backward = "B" if schedule.split_backward else "BW"
    if action.kind == "F":
        return Action("F", s - 1, i) if s > 0 else None
    if action.kind in ("B", "BW"):
        return Action("F", s, i) if s == last else Action(backward, s + 1, i)
    if action.kind == "W":
        return Action("B", s, i)
    raise ValueError(f"not a compute action: {action}")


def check_actions(schedule: PipelineSchedule) -> None:
    """Every action exactly once, on the rank holding its stage, and on each rank in an order its
    own dependencies allow (``F`` before its backward, ``B`` before its ``W``); raises
    ``ValueError``. Deadlock freedom across ranks: :func:`simulate` finishes."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "BW")
    expected = {Action(k, s, i) for k in kinds for s in range(schedule.stages) for i in range(schedule.microbatches)}
    seen = set()
    for rank, actions in enumerate(schedule.ranks):
        done = set()
        for action in actions:
            if action in seen:
                raise ValueError(f"{schedule.name}: {action} is scheduled twice")
            if action not in expected:
                raise ValueError(f"{schedule.name}: {action} is not an action of this schedule")
            if schedule.rank_of(action.stage) != rank:
                raise ValueError(f"{schedule.name}: {action} is on rank {rank}, its stage on rank {schedule.rank_of(action.stage)}")
            before = depends_on(schedule, action)
            own = Action("F", action.stage, action.microbatch) if action.kind != "F" else None
            for needed in (before, own):
                if needed is not None and schedule.rank_of(needed.stage) == rank and needed not in done:
                    raise ValueError(f"{schedule.name}: rank {rank} runs {action} before {needed}")
            seen.add(action)
            done.add(action)
    missing = expected - seen
    if missing:
        raise ValueError(f"{schedule.name}: {len(missing)} actions never run, e.g. {sorted(missing, key=str)[0]}")


# ---------------------------------------------------------------------------- simulation
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


def simulate(schedule: PipelineSchedule, costs: PassCosts = PassCosts(),
             stage_bytes: Optional[Mapping[int, tuple[float, float]]] = None,
             stage_costs: Optional[Mapping[int, PassCosts]] = None) -> Simulation:
    """Run every rank's list in order, each action as soon as the action before it on its rank
    and the one it depends on (plus ``costs.p2p`` when that one is on another rank) have ended.
    ``ValueError`` if the lists deadlock (an action waits for one that can never run).

    ``stage_costs``: each virtual stage's own costs (stages of unequal work: an uneven layout,
    the LM head's stage), used as given -- not halved under V placement; ``costs`` then gives
    only the p2p time.

    ``stage_bytes``: per virtual stage, ``(full, deferred)`` -- what one pass of that stage holds
    from its ``F``'s start to the end of its ``B`` (its activations), and from there to the end of
    its ``W`` (what the deferred weight-gradient GEMMs keep: the linears' inputs and output
    gradients); a ``BW`` holds ``full`` to its end. Gives :attr:`Simulation.peak_bytes`; stages
    left out hold nothing."""
    sim = Simulation(chunks_per_rank=schedule.chunks_per_rank)

    def cost(action: Action) -> float:
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


def rank_peak_bytes(schedule: PipelineSchedule, rank: int, stage_bytes: Mapping[int, tuple[float, float]]) -> float:
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


# ---------------------------------------------------------------------------- communication
def with_p2p(schedule: PipelineSchedule) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions with the sends and receives a runtime needs: a receive right before
    the compute that consumes what another rank sent, a send right after the compute that made
    it. Stage boundaries inside a rank (V placement's turn on rank ``p-1``) need neither."""
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        out = []
        for action in actions:
            if action.kind == "W":
                out.append(action)
                continue
            needed = depends_on(schedule, action)
            if needed is not None and schedule.rank_of(needed.stage) != rank:
                out.append(Action("RECV_F" if action.kind == "F" else "RECV_B", needed.stage, action.microbatch,
                                  schedule.rank_of(needed.stage)))
            out.append(action)
            consumer = _consumer(schedule, action)
            if consumer is not None and schedule.rank_of(consumer.stage) != rank:
                out.append(Action("SEND_F" if action.kind == "F" else "SEND_B", action.stage, action.microbatch,
                                  schedule.rank_of(consumer.stage)))
        ranks.append(tuple(out))
    return tuple(ranks)


def _consumer(schedule: PipelineSchedule, action: Action) -> Optional[Action]:
    """The action of another stage that waits for ``action`` (None: the last forward, whose
    backward is on its own stage, and the first stage's backward)."""
    backward = "B" if schedule.split_backward else "BW"
    if action.kind == "F":
        return Action("F", action.stage + 1, action.microbatch) if action.stage < schedule.stages - 1 else None
    if action.kind in ("B", "BW"):
        return Action(backward, action.stage - 1, action.microbatch) if action.stage > 0 else None
    return None


def channel_orders(schedule: PipelineSchedule) -> dict[tuple[int, int], tuple[list[str], list[str]]]:
    """For each ordered rank pair ``(sender, receiver)``: the messages in the order the sender
    sends them and in the order the receiver receives them (a runtime whose transport matches
    messages in order, as NCCL's does, needs the two equal)."""
    lists = with_p2p(schedule)
    channels: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
    for rank, actions in enumerate(lists):
        for action in actions:
            if action.kind.startswith("SEND"):
                channels.setdefault((rank, action.peer), ([], []))[0].append(f"{action.kind[-1]}{action.stage}.{action.microbatch}")
            elif action.kind.startswith("RECV"):
                channels.setdefault((action.peer, rank), ([], []))[1].append(f"{action.kind[-1]}{action.stage}.{action.microbatch}")
    return channels


def paper_peak(name: str, pp: int) -> float:
    """Peak in-flight micro-batches (of a rank's layers) on the busiest rank, as the paper gives
    them: 1F1B ``p``; V-Half ``(p + 2) // 2``; V-Min ``(p + 4) // 3``; 1F1B-V three quarters of
    1F1B (3 at ``p = 4``, 6 at ``p = 8``), here rounded up to half a micro-batch (one chunk)."""
    if name == "v-1f1b":
        return -(-3 * pp // 2) / 2
    return {"1f1b": pp, "v-half": (pp + 2) // 2, "v-min": (pp + 4) // 3}[name]
