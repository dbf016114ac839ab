"""NCCL's point-to-point rules as a pure model (runtime/p2p_rules.py), on hand-written programs
whose fate on NCCL is known: the crossing of two unbatched sends hangs (torch's documented reason
to batch), the same crossing batched runs; Megatron-Core's even/odd ordering of unbatched ops
runs; one in-order stream per channel; tags are ignored (a program that pairs by them gets the
wrong message); unbatched and batched ops never meet."""

import pytest

from epas_megatron.runtime.p2p_rules import RECV, SEND, Call, MessageMismatch, Op, Post, Progress, Wait, WouldDeadlock, run_programs


def unbatched(kind, peer, label="", group="pp"):
    return Post(Call((Op(kind, peer, label),), group, batched=False))


def batch(*ops, group="pp"):
    return Post(Call(tuple(Op(*op) for op in ops), group))


def test_two_unbatched_sends_that_cross_hang_and_the_report_names_both_ranks():
    programs = [[unbatched(SEND, 1, "a"), unbatched(RECV, 1, "b"), Wait(1), Wait(0)],
                [unbatched(SEND, 0, "b"), unbatched(RECV, 0, "a"), Wait(1), Wait(0)]]
    with pytest.raises(WouldDeadlock) as caught:
        run_programs(programs)
    report = str(caught.value)
    assert report.startswith("would deadlock on NCCL")
    assert "rank 0: call #1 (unbatched on group pp: recv b <- 1) has not started: it is behind its own call #0" in report
    assert "rank 1: call #1 (unbatched on group pp: recv a <- 0) has not started" in report


def test_the_same_crossing_batched_runs_and_so_does_one_side_receiving_first():
    run_programs([[batch((SEND, 1, "a"), (RECV, 1, "b")), Wait(0)], [batch((SEND, 0, "b"), (RECV, 0, "a")), Wait(0)]])
    run_programs([[unbatched(SEND, 1, "a"), unbatched(RECV, 1, "b"), Wait(1), Wait(0)],
                  [unbatched(RECV, 0, "a"), unbatched(SEND, 0, "b"), Wait(0), Wait(1)]])


def test_a_ring_of_blocking_sends_hangs_and_megatrons_even_odd_order_runs():
    """Four ranks each send to the next and receive from the previous, waiting for each call
    (``send`` / ``recv``): all sending first hangs (a send waits for its receive); even ranks
    sending first and odd ranks receiving first (as p2p_communication._p2p_ops orders) runs. Posted
    without waiting, each pair's calls are on a channel of its own and the ring runs."""
    def ring(first_send: bool, rank: int, wait: bool = True):
        send, recv = unbatched(SEND, (rank + 1) % 4, f"{rank}"), unbatched(RECV, (rank - 1) % 4, f"{(rank - 1) % 4}")
        if not wait:
            return [send, recv, Wait(0), Wait(1)]
        return [send, Wait(0), recv, Wait(1)] if first_send else [recv, Wait(0), send, Wait(1)]

    with pytest.raises(WouldDeadlock):
        run_programs([ring(True, r) for r in range(4)])
    run_programs([ring(r % 2 == 0, r) for r in range(4)])
    run_programs([ring(True, r, wait=False) for r in range(4)])


def test_a_rank_that_finishes_without_receiving_leaves_the_send_hanging():
    with pytest.raises(WouldDeadlock, match="rank 1 has finished"):
        run_programs([[unbatched(SEND, 1), Wait(0)], []])
    with pytest.raises(WouldDeadlock, match=r"rank 1 has not posted the matching receive"):
        run_programs([[unbatched(SEND, 1), Wait(0)], [unbatched(SEND, 0), Wait(0)]])


def test_batched_calls_of_a_rank_run_in_order_even_to_other_peers():
    """Rank 0 batches a send to rank 1 (which never receives it), then a send to rank 2: on the
    group's one stream the second waits behind the first, so rank 2's receive hangs. Unbatched,
    the two sends are on different pair channels and rank 2 gets its message."""
    with pytest.raises(WouldDeadlock) as caught:
        run_programs([[batch((SEND, 1, "x")), batch((SEND, 2, "y"))], [], [batch((RECV, 0, "y")), Wait(0)]])
    assert "rank 2: call #0 (batch on group pp: recv y <- 0) waits: recv y <- 0: rank 0's send is its call #1, behind its call #0" \
        in str(caught.value)
    progress = Progress()
    progress.post(0, Call((Op(SEND, 1, "x"),), "pp", batched=False))
    progress.post(0, Call((Op(SEND, 2, "y"),), "pp", batched=False))
    progress.post(2, Call((Op(RECV, 0, "y"),), "pp", batched=False))
    progress.settle()
    assert progress.completed(2, 0) and progress.completed(0, 1) and not progress.completed(0, 0)


def test_groups_are_channels_of_their_own():
    """The same crossing on two groups (one each way, as Megatron's _p2p_ops does with the
    pipeline group and WORLD at p = 2) runs: each direction has its own stream."""
    run_programs([[unbatched(SEND, 1, "a", "pp"), unbatched(RECV, 1, "b", "world"), Wait(1), Wait(0)],
                  [unbatched(SEND, 0, "b", "world"), unbatched(RECV, 0, "a", "pp"), Wait(1), Wait(0)]])


def test_unbatched_and_batched_ops_never_meet():
    with pytest.raises(WouldDeadlock):
        run_programs([[unbatched(SEND, 1, "a"), Wait(0)], [batch((RECV, 0, "a")), Wait(0)]])


def test_tags_are_ignored_messages_meet_in_posting_order():
    with pytest.raises(MessageMismatch, match="pair rank 0's send F0.0 with rank 1's receive F0.1"):
        run_programs([[unbatched(SEND, 1, "F0.0"), unbatched(SEND, 1, "F0.1"), Wait(0), Wait(1)],
                      [unbatched(RECV, 0, "F0.1"), unbatched(RECV, 0, "F0.0"), Wait(0), Wait(1)]])
    progress = run_programs([[unbatched(SEND, 1, "F0.0"), unbatched(SEND, 1, "F0.1"), Wait(1)],
                             [unbatched(RECV, 0, "F0.0"), unbatched(RECV, 0, "F0.1"), Wait(1)]])
    assert progress.slot(0, 1, 0) == progress.slot(1, 1, 0) == 1


def test_a_call_completes_only_when_every_op_of_it_has():
    progress = Progress()
    progress.post(0, Call((Op(SEND, 1, "a"), Op(RECV, 2, "c"))))
    progress.post(1, Call((Op(RECV, 0, "a"),)))
    progress.settle()
    assert progress.started(0, 0) and progress.completed(1, 0) and not progress.completed(0, 0)
    progress.post(2, Call((Op(SEND, 0, "c"),)))
    progress.settle()
    assert progress.completed(0, 0) and progress.completed(2, 0)
    with pytest.raises(ValueError, match="to itself"):
        progress.post(0, Call((Op(SEND, 0),)))
