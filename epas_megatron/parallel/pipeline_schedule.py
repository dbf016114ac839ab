"""Pipeline schedules as data: what each ``--pipeline-schedule`` is (:class:`PipelineSchedule`,
one registry: placement, split backward, refusals), and its per-rank action lists.

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

A schedule's action lists are a list of compute actions per rank (:class:`Action`);
:func:`with_p2p` adds the sends and receives a runtime needs, and
:mod:`epas_megatron.parallel.schedule_simulation` runs the lists with any ``F``/``B``/``W``
costs (the execution times, the bubble, each rank's peak activations). :func:`channel_orders` says whether every rank
pair's messages are received in the order they are sent (1F1B, V-Half and V-Min: yes; v-1f1b:
no, so its runtime must post receives in the senders' order). Nothing here touches a process or
a tensor: the executor (``engine/pipeline_executor.py``) runs the lists, the memory model and
``epas-plan`` price them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from epas_megatron.errors import ConfigError
from epas_megatron.model.v_placement import v_chunk, v_rank


@dataclass(frozen=True)
class ScheduleFacts:
    """What decides whether a pipeline schedule can run: the run's facts."""

    pp: int
    """Pipeline ranks (``--pp``)."""

    microbatches: int
    """Micro-batches per iteration and DP rank."""

    vpp: Optional[int] = None
    """Model chunks per rank asked for (``--vpp``)."""

    num_layers: Optional[int] = None
    """Decoder layers (None: not known, not checked)."""

    tied_embeddings: bool = False
    """The LM head shares the embedding's weight."""

    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``."""

    backend: str = "local"
    """The layers: ``local`` or ``transformer_engine``."""


@dataclass(frozen=True)
class PipelineSchedule:
    """One ``--pipeline-schedule``: where it places the layers, whether it splits the backward
    pass, who runs it, what it refuses -- the one place a schedule's name decides anything."""

    name: str
    """The ``--pipeline-schedule`` value."""

    placement: str
    """``stages`` (stage ``s`` on rank ``s``), ``interleaved`` (Megatron-Core's virtual stages,
    ``--vpp`` chunks per rank) or ``v`` (two chunks per rank in V order, both ends on rank 0)."""

    split_backward: bool
    """Runs the weight-gradient backward (``W``) apart from the input-gradient one (``B``)."""

    executor: bool
    """Run by this project's executor from its action lists (:func:`build_schedule`); else by
    Megatron-Core's own schedule."""

    paper_units: str
    """Its peak in-flight micro-batches as Qi et al. give it (in terms of ``p``)."""

    def __str__(self) -> str:
        return self.name

    @property
    def v_placement(self) -> bool:
        return self.placement == "v"

    def chunks_per_rank(self, vpp: Optional[int] = None) -> Optional[int]:
        """Model chunks on each pipeline rank (None: one, without interleaving)."""
        return 2 if self.v_placement else vpp

    def refusals(self, facts: ScheduleFacts, flag: str = "--pipeline-schedule") -> list[str]:
        """Everything that stops this schedule from running with ``facts``, each naming the flag
        to change (validation raises the first; ``epas-plan`` lists them)."""
        out = []
        if self.placement == "stages" and facts.vpp:
            out.append(f"{flag} {self.name} runs one chunk per rank: drop --vpp {facts.vpp} (or use {flag} interleaved)")
        if self.placement == "interleaved" and not facts.vpp:
            out.append(f"{flag} interleaved needs --vpp >= 2 (or an interleaved --pipeline-layout)")
        if not self.v_placement:
            return out
        if facts.pp < 2:
            out.append(f"{flag} {self.name} needs --pp >= 2 (a V schedule places two model chunks on each pipeline rank)")
        if facts.vpp is not None and facts.vpp > 1:
            out.append(f"{flag} {self.name} places two chunks per rank itself: drop --vpp {facts.vpp} (or use {flag} interleaved)")
        if facts.microbatches < facts.pp:
            out.append(f"{flag} {self.name} with --pp {facts.pp} needs at least {facts.pp} micro-batches per iteration, got "
                       f"{facts.microbatches}: raise --global-batch-size or lower --micro-batch-size")
        if self.split_backward and facts.backend != "local":
            out.append(f"{flag} {self.name} splits the backward pass, which is built for the local layers only "
                       "(Transformer Engine's delay_wgrad_compute is not wired yet); use --transformer-impl local "
                       f"or {flag} v-1f1b")
        if facts.tied_embeddings:
            out.append(f"{flag} {self.name} does not run with --no-untie-embeddings-and-output-weights (the embedding "
                       f"and the LM head are two chunks of rank 0) yet; drop it or use {flag} 1f1b")
        if facts.overlap_grad_reduce:
            out.append(f"{flag} {self.name} does not run with --overlap-grad-reduce (the executor reduces after the "
                       f"iteration) yet; drop it or use {flag} 1f1b")
        if facts.num_layers is not None and facts.num_layers < 2 * facts.pp:
            out.append(f"{flag} {self.name} splits the layers over 2 x --pp {facts.pp} = {2 * facts.pp} stages; "
                       f"--num-layers {facts.num_layers} is too few")
        return out

    def check(self, facts: ScheduleFacts, flag: str = "--pipeline-schedule") -> None:
        """Raise the first of :meth:`refusals` (a ``ConfigError``)."""
        refusals = self.refusals(facts, flag)
        if refusals:
            raise ConfigError(refusals[0])

    def actions(self, pp: int, microbatches: int) -> "ScheduleActions":
        """Its per-rank action lists (:func:`build_schedule`)."""
        return build_schedule(self.name, pp, microbatches)


PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {s.name: s for s in (
    PipelineSchedule("1f1b", "stages", split_backward=False, executor=False, paper_units="p"),
    PipelineSchedule("interleaved", "interleaved", split_backward=False, executor=False, paper_units="--"),
    PipelineSchedule("v-1f1b", "v", split_backward=False, executor=True, paper_units="3p/4"),
    PipelineSchedule("v-half", "v", split_backward=True, executor=True, paper_units="(p+2)//2"),
    PipelineSchedule("v-min", "v", split_backward=True, executor=True, paper_units="(p+4)//3"),
)}
"""Every ``--pipeline-schedule``: Megatron-Core's two, and the V schedules of this module."""


def megatron_schedule(vpp: Optional[int] = None) -> PipelineSchedule:
    """Megatron-Core's own schedule for ``vpp`` chunks per rank (the default ``--pipeline-schedule``):
    interleaved with ``--vpp``, else 1F1B -- also the baseline every schedule is compared with."""
    return PIPELINE_SCHEDULES["interleaved" if vpp else "1f1b"]


def pipeline_schedule(name: str, flag: str = "--pipeline-schedule") -> PipelineSchedule:
    """The schedule called ``name``; a ``ConfigError`` naming ``flag`` for any other name."""
    if name not in PIPELINE_SCHEDULES:
        raise ConfigError(f"{flag} {name!r}: choose one of {', '.join(PIPELINE_SCHEDULES)}")
    return PIPELINE_SCHEDULES[name]


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
class ScheduleActions:
    """The per-rank action lists of one schedule for ``pp`` ranks and ``microbatches``."""

    name: str
    """One of :data:`PIPELINE_SCHEDULES` (not 'interleaved': Megatron-Core runs that one)."""

    pp: int
    """Pipeline ranks."""

    microbatches: int
    """Micro-batches per iteration."""

    ranks: tuple[tuple[Action, ...], ...]
    """Compute actions of each rank, in the order the rank runs them."""

    @property
    def kind(self) -> PipelineSchedule:
        return PIPELINE_SCHEDULES[self.name]

    @property
    def v_placement(self) -> bool:
        return self.kind.v_placement

    @property
    def stages(self) -> int:
        """Virtual stages: ``2p`` under V placement, else ``p``."""
        return 2 * self.pp if self.v_placement else self.pp

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.v_placement else 1

    @property
    def split_backward(self) -> bool:
        return self.kind.split_backward

    @functools.cached_property
    def p2p_lists(self) -> tuple[tuple[Action, ...], ...]:
        """:func:`with_p2p` of this schedule, made once (the executor reads it every step)."""
        return with_p2p(self)

    def rank_of(self, stage: int) -> int:
        return v_rank(stage, self.pp) if self.v_placement else stage

    def chunk_of(self, stage: int) -> int:
        return v_chunk(stage, self.pp) if self.v_placement else 0


@functools.lru_cache(maxsize=32)
def build_schedule(name: str, pp: int, microbatches: int) -> ScheduleActions:
    """The per-rank compute actions of schedule ``name`` (see the module doc); made once per
    arguments (the trainer asks for it every step)."""
    kind = pipeline_schedule(name)
    kind.check(ScheduleFacts(pp, microbatches))
    if kind.placement == "interleaved":
        raise ConfigError(f"--pipeline-schedule {name} is Megatron-Core's own schedule: it has no action lists here")
    if name == "1f1b":
        return ScheduleActions(name, pp, microbatches, tuple(_one_f_one_b(pp, r, microbatches) for r in range(pp)))
    return ScheduleActions(name, pp, microbatches, tuple(_from_block(name, pp, r, microbatches) for r in range(pp)))


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
    if not PIPELINE_SCHEDULES[name].split_backward:
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
def depends_on(schedule: ScheduleActions, action: Action) -> Optional[Action]:
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


def check_actions(schedule: ScheduleActions) -> None:
    """Every action exactly once, on the rank holding its stage, and on each rank in an order its
    own dependencies allow (``F`` before its backward, ``B`` before its ``W``); raises
    ``ValueError``. Deadlock freedom across ranks: the simulation finishes."""
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


# ---------------------------------------------------------------------------- communication
def with_p2p(schedule: ScheduleActions) -> tuple[tuple[Action, ...], ...]:
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


def _consumer(schedule: ScheduleActions, action: Action) -> Optional[Action]:
    """The action of another stage that waits for ``action`` (None: the last forward, whose
    backward is on its own stage, and the first stage's backward)."""
    backward = "B" if schedule.split_backward else "BW"
    if action.kind == "F":
        return Action("F", action.stage + 1, action.microbatch) if action.stage < schedule.stages - 1 else None
    if action.kind in ("B", "BW"):
        return Action(backward, action.stage - 1, action.microbatch) if action.stage > 0 else None
    return None


def channel_orders(schedule: ScheduleActions) -> dict[tuple[int, int], tuple[list[str], list[str]]]:
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
