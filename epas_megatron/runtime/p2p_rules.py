"""NCCL's point-to-point rules as a pure model: of the sends and receives every rank has posted,
which can finish.

gloo and NCCL accept the same calls and behave differently: gloo buffers a send and matches
messages by tag, so any order of ``isend`` / ``irecv`` passes there; NCCL does neither. This
module writes NCCL's behaviour down as rules, with no process and no tensor, so that a program's
order of calls can be checked without a GPU -- by the pure check of the pipeline executor's plan
(:mod:`epas_megatron.parallel.pipeline_p2p`) and, under real processes on gloo, by the transport
that makes every point-to-point call of a run obey them (:mod:`epas_megatron.compat.nccl_rules`).

The rules (torch's ``ProcessGroupNCCL::pointToPoint`` and NCCL's semantics):

1. **Channels.** Unbatched ``isend`` / ``irecv`` between ranks ``a`` and ``b`` of a process group
   go through that group's communicator of the pair (torch keys it ``"a:b"``); the ops of one
   ``batch_isend_irecv`` call go through the group's communicator of all its ranks (torch keys
   batched point-to-point like a collective). Each communicator runs on one stream per rank:
   the calls a rank posts on one channel run one after the other, in the order it posted them.
   A call *starts* once every earlier call of its rank on its channel has completed.
2. **Matching.** On a channel, the ``k``-th send from ``a`` to ``b`` meets the ``k``-th receive
   at ``b`` from ``a``. Tags are ignored: a program that relies on them to pair messages gets
   another pairing (reported here as a mismatch of the ops' labels).
3. **Rendezvous.** Every message is taken as large (beyond NCCL's buffers): a send completes only
   once its matching receive has started on the peer, and a receive once its send has started.
4. **Batches.** The ops of one call start together; the call completes when all of them have.

A rank that waits on a call blocks until it completes (on a GPU the compute stream waits and the
host issues behind it: the same order). Completion only grows as more calls are posted, so a
state where every rank waits on a call that cannot complete with what has been posted is a
deadlock for good: :func:`run_programs` reports it as NCCL would hang on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

SEND = "send"
RECV = "recv"


class WouldDeadlock(RuntimeError):
    """The calls posted would hang on NCCL (the message names every blocked rank and why)."""


class MessageMismatch(RuntimeError):
    """NCCL would pair a send with a receive of another message (tags are ignored there)."""


@dataclass(frozen=True)
class Op:
    """One send or receive of a call."""

    kind: str
    """:data:`SEND` or :data:`RECV`."""

    peer: int
    """The other side's global rank."""

    label: str = ""
    """What the caller means to move (a message name, a tag, a shape): NCCL ignores it; two matched
    ops with different non-empty labels are a :class:`MessageMismatch`."""

    def __str__(self) -> str:
        arrow = "->" if self.kind == SEND else "<-"
        return f"{self.kind} {self.label + ' ' if self.label else ''}{arrow} {self.peer}"


@dataclass(frozen=True)
class Call:
    """One call a rank posts: an unbatched ``isend`` / ``irecv`` (one op), or one batch."""

    ops: tuple[Op, ...]
    group: str = "world"
    """The process group's name (each group has communicators of its own)."""

    batched: bool = True
    """A ``batch_isend_irecv`` call (the group's communicator); else one unbatched op (the pair's)."""

    def channel(self, rank: int) -> tuple:
        """The channel (communicator and its stream) this call runs on at ``rank``."""
        if self.batched:
            return ("batch", self.group)
        (op,) = self.ops
        return ("pair", self.group, min(rank, op.peer), max(rank, op.peer))

    def describe(self, rank: int) -> str:
        how = f"batch on group {self.group}" if self.batched else f"unbatched on group {self.group}"
        return f"{how}: {', '.join(map(str, self.ops))}"


@dataclass(frozen=True)
class Post:
    """A program step: post ``call`` (the rank's posts are numbered 0, 1, ... in order)."""

    call: Call


@dataclass(frozen=True)
class Wait:
    """A program step: block until the rank's post number ``index`` has completed."""

    index: int


Step = Union[Post, Wait]


class Progress:
    """The calls every rank has posted, and which of them have started and completed under the
    rules (recomputed by :meth:`settle`; posting more only lets more complete)."""

    def __init__(self) -> None:
        self.calls: dict[int, list[Call]] = {}
        self._queues: dict[tuple[int, tuple], list[int]] = {}  # (rank, channel) -> its calls' indices, in order
        self._completed_in_queue: dict[tuple[int, tuple], int] = {}
        self._position: dict[tuple[int, int], tuple] = {}  # (rank, call) -> (its queue, its place there)
        self._ops: dict[tuple, tuple[list, list]] = {}  # (channel, sender, receiver) -> (sends, receives): (rank, call, op)
        self._match: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        self._slot: dict[tuple[int, int, int], int] = {}

    # ------------------------------------------------------------------ posting
    def post(self, rank: int, call: Call) -> int:
        """Record ``call`` as ``rank``'s next post; returns its index. Raises
        :class:`MessageMismatch` when an op meets a counterpart of another label."""
        calls = self.calls.setdefault(rank, [])
        index = len(calls)
        calls.append(call)
        channel = call.channel(rank)
        queue = self._queues.setdefault((rank, channel), [])
        self._position[(rank, index)] = ((rank, channel), len(queue))
        queue.append(index)
        self._completed_in_queue.setdefault((rank, channel), 0)
        for k, op in enumerate(call.ops):
            if op.peer == rank:
                raise ValueError(f"rank {rank} posts a {op.kind} to itself")
            sender, receiver = (rank, op.peer) if op.kind == SEND else (op.peer, rank)
            slots = self._ops.setdefault((channel, sender, receiver), ([], []))
            mine, theirs = (slots[0], slots[1]) if op.kind == SEND else (slots[1], slots[0])
            place = self._slot[(rank, index, k)] = len(mine)
            mine.append((rank, index, k))
            if place < len(theirs):
                self._pair((rank, index, k), theirs[place])
        return index

    def _pair(self, mine: tuple[int, int, int], theirs: tuple[int, int, int]) -> None:
        self._match[mine], self._match[theirs] = theirs, mine
        a, b = self.op(*mine), self.op(*theirs)
        if a.label and b.label and a.label != b.label:
            send, recv = (mine, theirs) if a.kind == SEND else (theirs, mine)
            raise MessageMismatch(
                f"NCCL would pair rank {send[0]}'s send {self.op(*send).label} with rank {recv[0]}'s receive "
                f"{self.op(*recv).label} (on a channel messages meet in the order posted; tags are ignored)")

    def op(self, rank: int, index: int, k: int) -> Op:
        return self.calls[rank][index].ops[k]

    def slot(self, rank: int, index: int, k: int) -> int:
        """Which message of its channel and direction op ``k`` of ``rank``'s post ``index`` is (0, 1,
        ...): the same number at the send and at the receive it meets."""
        return self._slot[(rank, index, k)]

    # ------------------------------------------------------------------ progress
    def started(self, rank: int, index: int) -> bool:
        queue, place = self._position[(rank, index)]
        return place <= self._completed_in_queue[queue]

    def completed(self, rank: int, index: int) -> bool:
        queue, place = self._position[(rank, index)]
        return place < self._completed_in_queue[queue]

    def _op_done(self, rank: int, index: int, k: int) -> bool:
        other = self._match.get((rank, index, k))
        return other is not None and self.started(other[0], other[1])

    def settle(self) -> None:
        """Advance every channel as far as the rules allow."""
        moved = True
        while moved:
            moved = False
            for queue, calls in self._queues.items():
                rank = queue[0]
                done = self._completed_in_queue[queue]
                while done < len(calls) and all(self._op_done(rank, calls[done], k) for k in range(len(self.calls[rank][calls[done]].ops))):
                    done += 1
                    moved = True
                self._completed_in_queue[queue] = done

    # ------------------------------------------------------------------ reports
    def why_waiting(self, rank: int, index: int) -> str:
        """What keeps ``rank``'s post ``index`` from completing, op by op."""
        call = self.calls[rank][index]
        if not self.started(rank, index):
            queue, place = self._position[(rank, index)]
            ahead = self._queues[queue][self._completed_in_queue[queue]]
            return (f"call #{index} ({call.describe(rank)}) has not started: it is behind its own call #{ahead} "
                    f"({self.calls[rank][ahead].describe(rank)}) on the same stream")
        reasons = []
        for k, op in enumerate(call.ops):
            if self._op_done(rank, index, k):
                continue
            other = self._match.get((rank, index, k))
            what = "receive" if op.kind == SEND else "send"
            if other is None:
                reasons.append(f"{op}: rank {op.peer} has not posted the matching {what}")
            else:
                queue, _ = self._position[(other[0], other[1])]
                ahead = self._queues[queue][self._completed_in_queue[queue]]
                reasons.append(f"{op}: rank {op.peer}'s {what} is its call #{other[1]}, behind its call #{ahead} "
                               f"({self.calls[other[0]][ahead].describe(other[0])}) on the same stream")
        return f"call #{index} ({call.describe(rank)}) waits: " + "; ".join(reasons)

    def deadlock_report(self, waiting: dict[int, Optional[int]]) -> str:
        """``waiting``: rank -> the post it waits on (None: the rank has finished its program)."""
        lines = []
        for rank in sorted(waiting):
            index = waiting[rank]
            if index is None:
                pending = [i for i in range(len(self.calls.get(rank, []))) if not self.completed(rank, i)]
                lines.append(f"rank {rank} has finished" + (f", its calls {pending} never complete" if pending else ""))
            else:
                lines.append(f"rank {rank}: {self.why_waiting(rank, index)}")
        return "would deadlock on NCCL:\n  " + "\n  ".join(lines)


def run_programs(programs: Sequence[Sequence[Step]]) -> Progress:
    """Run every rank's program (posts and waits) under the rules, each rank as far as its waits
    allow, until all have finished and every posted call has completed (returns the
    :class:`Progress`). Raises :class:`WouldDeadlock` naming each blocked rank and the ops it waits
    on, or :class:`MessageMismatch`."""
    progress = Progress()
    position = [0] * len(programs)
    while True:
        moved = False
        for rank, program in enumerate(programs):
            while position[rank] < len(program):
                step = program[position[rank]]
                if isinstance(step, Post):
                    progress.post(rank, step.call)
                elif not progress.completed(rank, step.index):
                    progress.settle()
                    if not progress.completed(rank, step.index):
                        break
                position[rank] += 1
                moved = True
        progress.settle()
        if all(p == len(program) for p, program in zip(position, programs)):
            break
        if not moved:
            waiting = {rank: (program[position[rank]].index if position[rank] < len(program) else None)
                       for rank, program in enumerate(programs)}
            raise WouldDeadlock(progress.deadlock_report(waiting))
    unfinished = {rank: None for rank, calls in progress.calls.items() if not all(progress.completed(rank, i) for i in range(len(calls)))}
    if unfinished:
        raise WouldDeadlock(progress.deadlock_report(unfinished))
    return progress
