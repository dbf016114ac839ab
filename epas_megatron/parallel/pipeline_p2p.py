"""The pipeline executor's communication plan: which sends and receives go out together, when a
rank waits, and the plan checked under NCCL's point-to-point rules -- all pure functions of a
schedule's action lists (:mod:`epas_megatron.parallel.pipeline_schedule`).

**The design** (what ``engine/pipeline_executor.py`` runs, on every backend alike). Between two
compute actions of a rank, its sends and receives form one *exchange*, posted as one
``batch_isend_irecv`` call: the sends of the pass that just ran and the receives the next pass
needs -- what Megatron-Core's 1F1B does with ``send_forward_recv_backward``. Batching is what
NCCL needs: a send larger than its buffers finishes only when the peer's receive runs, and
unbatched calls between two ranks run one after the other on one stream, so two neighbours that
each send before receiving the other's message hang; the ops of one batch start together. On a
channel NCCL pairs messages in the order posted (tags are ignored), so receives are posted in the
order the peer sends: a message the peer sent before the one needed now is received in the same
exchange, before it (v-1f1b consumes some messages out of their sending order).

A rank waits for an exchange that receives (its next pass needs the data); an exchange that only
sends is not waited for, so the pass after it overlaps the transfer. A waited exchange completes
after every earlier call of the rank (they run in order on the group's stream), so the rank then
waits for those sends too and drops them: a sent tensor lives from its pass to the next waited
exchange at the latest (:func:`sends_in_flight` counts them), never to the iteration's end.

:func:`nccl_programs` turns a plan into the posts and waits :mod:`epas_megatron.runtime.p2p_rules`
runs; :func:`check_plan` raises where NCCL would hang or pair the wrong messages.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import Union

from epas_megatron.parallel.pipeline_schedule import COMPUTE, Action, ScheduleActions
from epas_megatron.runtime.p2p_rules import RECV, SEND, Call, Op, Post, Progress, Wait, run_programs


@dataclass(frozen=True)
class Exchange:
    """One ``batch_isend_irecv`` call of a rank, between two of its compute actions."""

    sends: tuple[Action, ...]
    """``SEND_F`` / ``SEND_B`` of the pass before, in order."""

    receives: tuple[Action, ...]
    """``RECV_F`` / ``RECV_B``, in the order each peer sends them (some for later passes)."""

    waits: bool
    """The rank waits for this exchange (and so for every earlier one) before its next pass: it
    receives, or leaving it pending would leave more than :data:`PENDING_SENDS` sends pending."""

    def ops(self) -> tuple[Action, ...]:
        """The ops in the order they are posted: the sends, then the receives."""
        return self.sends + self.receives


PlanStep = Union[Action, Exchange]

PENDING_SENDS = 1
"""Sends a rank may leave pending (not waited for) across its next pass: a send overlaps at most
one pass; the exchange after it waits for it (the rank then holds at most two sent tensors)."""


def message(action: Action) -> str:
    """A message's name, the same at its send and its receive: ``F2.1`` is stage 2's forward output
    of micro-batch 1, ``B3.0`` stage 3's input gradient of micro-batch 0."""
    return f"{action.kind[-1]}{action.stage}.{action.microbatch}"


def p2p_actions(schedule: ScheduleActions, forward_only: bool = False) -> tuple[tuple[Action, ...], ...]:
    """:attr:`ScheduleActions.p2p_lists`, or for a forward-only run its forwards and their messages."""
    if not forward_only:
        return schedule.p2p_lists
    return tuple(tuple(a for a in actions if a.kind in ("F", "RECV_F", "SEND_F")) for actions in schedule.p2p_lists)


@functools.lru_cache(maxsize=64)
def communication_plan(schedule: ScheduleActions, forward_only: bool = False) -> tuple[tuple[PlanStep, ...], ...]:
    """Every rank's compute actions with its :class:`Exchange` s between them (see the module doc);
    made once per schedule (the executor reads it every step)."""
    lists = p2p_actions(schedule, forward_only)
    plans = []
    for rank, actions in enumerate(lists):
        # What each peer sends this rank, in its order: receives are posted in that order.
        incoming = {src: deque(message(a) for a in lists[src] if a.kind.startswith("SEND") and a.peer == rank)
                    for src in range(schedule.pp)}
        posted: set[str] = set()
        plan: list[PlanStep] = []
        sends: list[Action] = []
        receives: list[Action] = []
        pending = 0

        def close() -> None:
            nonlocal pending
            if sends or receives:
                waits = bool(receives) or pending + len(sends) > PENDING_SENDS
                plan.append(Exchange(tuple(sends), tuple(receives), waits))
                pending = 0 if waits else pending + len(sends)
                sends.clear()
                receives.clear()

        for action in actions:
            if action.kind in COMPUTE:
                close()
                plan.append(action)
            elif action.kind.startswith("SEND"):
                sends.append(action)
            else:
                wanted = message(action)
                while wanted not in posted:
                    early = incoming[action.peer].popleft()
                    kind, stage_mb = early[0], early[1:]
                    stage, microbatch = (int(x) for x in stage_mb.split("."))
                    receives.append(Action("RECV_" + kind, stage, microbatch, action.peer))
                    posted.add(early)
                posted.discard(wanted)
        close()
        plans.append(tuple(plan))
    return tuple(plans)


def sends_in_flight(schedule: ScheduleActions, forward_only: bool = False) -> tuple[int, ...]:
    """Per rank: the most sent tensors the executor holds at once under :func:`communication_plan`
    -- each from its exchange until the next exchange the rank waits for has completed (or the
    iteration's end)."""
    peaks = []
    for plan in communication_plan(schedule, forward_only):
        held = peak = 0
        for step in plan:
            if isinstance(step, Exchange):
                held += len(step.sends)
                peak = max(peak, held)
                if step.waits:
                    held = 0
        peaks.append(peak)
    return tuple(peaks)


def nccl_programs(schedule: ScheduleActions, forward_only: bool = False, group: str = "pipeline") -> list[list]:
    """The plan as :mod:`~epas_megatron.runtime.p2p_rules` programs: each exchange one batched
    post; a waited exchange waited for with every earlier post; at the end, every post."""
    programs = []
    for plan in communication_plan(schedule, forward_only):
        program: list = []
        posts = 0
        for step in plan:
            if not isinstance(step, Exchange):
                continue
            ops = tuple(Op(SEND if a.kind.startswith("SEND") else RECV, a.peer, message(a)) for a in step.ops())
            program.append(Post(Call(ops, group)))
            posts += 1
            if step.waits:
                program.append(Wait(posts - 1))
        program += [Wait(i) for i in range(posts)]
        programs.append(program)
    return programs


def check_plan(schedule: ScheduleActions, forward_only: bool = False) -> Progress:
    """Run :func:`nccl_programs` under NCCL's rules; raises
    :class:`~epas_megatron.runtime.p2p_rules.WouldDeadlock` or ``MessageMismatch`` naming the
    schedule."""
    try:
        return run_programs(nccl_programs(schedule, forward_only))
    except RuntimeError as error:
        what = "forward-only" if forward_only else "training"
        raise type(error)(f"{schedule.name} p={schedule.pp} m={schedule.microbatches} ({what}): {error}") from None
