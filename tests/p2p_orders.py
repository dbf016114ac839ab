"""Point-to-point programs for the NCCL-rules tests, as plain data (JSON-able, so a test script
under torchrun runs them with real tensors) and as :mod:`epas_megatron.runtime.p2p_rules`
programs (so the pure model judges the same steps).

A program is a list per rank of steps: ``["post", batched, [[kind, peer, label], ...]]`` (one
call: a ``batch_isend_irecv`` or one unbatched ``isend`` / ``irecv``) or ``["wait", index]``
(wait for the rank's post number ``index``). A label names a message; a send fills its tensor with
the label's number and a receive checks what arrived.
"""

from __future__ import annotations

from collections import deque

from epas_megatron.parallel.pipeline_p2p import message, p2p_actions
from epas_megatron.runtime.p2p_rules import Call, Op, Post, Wait


def legacy_executor_programs(schedule, forward_only: bool = False) -> list[list]:
    """The pipeline executor's issue order before its communication plan (commit 91852de): each
    send an unbatched isend right after its pass, each receive an unbatched irecv (the messages the
    peer sent earlier first, in its order) waited for right before the pass that takes it, every
    send waited for at the iteration's end."""
    lists = p2p_actions(schedule, forward_only)
    programs = []
    for rank, actions in enumerate(lists):
        incoming = {src: deque(message(a) for a in lists[src] if a.kind.startswith("SEND") and a.peer == rank)
                    for src in range(schedule.pp)}
        posted, program, sends = {}, [], []
        for action in actions:
            if action.kind.startswith("RECV"):
                while message(action) not in posted:
                    early = incoming[action.peer].popleft()
                    posted[early] = sum(step[0] == "post" for step in program)
                    program.append(["post", False, [["recv", action.peer, early]]])
                program.append(["wait", posted.pop(message(action))])
            elif action.kind.startswith("SEND"):
                sends.append(sum(step[0] == "post" for step in program))
                program.append(["post", False, [["send", action.peer, message(action)]]])
        programs.append(program + [["wait", index] for index in sends])
    return programs


def crossing_programs(batched: bool) -> list[list]:
    """Two ranks each send the other a message and receive the other's, sends first."""
    if batched:
        return [[["post", True, [["send", 1 - r, f"m{r}"], ["recv", 1 - r, f"m{1 - r}"]]], ["wait", 0]] for r in (0, 1)]
    return [[["post", False, [["send", 1 - r, f"m{r}"]]], ["post", False, [["recv", 1 - r, f"m{1 - r}"]]], ["wait", 1], ["wait", 0]]
            for r in (0, 1)]


def tag_order_programs() -> list[list]:
    """Rank 0 sends a then b; rank 1 receives b then a: gloo pairs them by tag, NCCL by order."""
    return [[["post", False, [["send", 1, "a"]]], ["post", False, [["send", 1, "b"]]], ["wait", 0], ["wait", 1]],
            [["post", False, [["recv", 0, "b"]]], ["post", False, [["recv", 0, "a"]]], ["wait", 0], ["wait", 1]]]


def as_rules(programs: list[list], group: str, label=lambda text: text) -> list[list]:
    """The same programs as p2p_rules steps on process group ``group`` (``label`` maps a message
    name to the op label the transport reports)."""
    return [[Post(Call(tuple(Op(kind, peer, label(text)) for kind, peer, text in step[2]), group, batched=step[1]))
             if step[0] == "post" else Wait(step[1]) for step in program] for program in programs]


def labels(programs: list[list]) -> list[str]:
    """Every message's name, in a fixed order (a message's tag is its place here)."""
    return sorted({text for program in programs for step in program if step[0] == "post" for _, _, text in step[2]})
