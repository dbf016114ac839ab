"""The executor's communication plan (parallel/pipeline_p2p.py) under NCCL's point-to-point rules
(runtime/p2p_rules.py), without processes: every schedule the executor runs, p in {2, 4, 8} and
m from p to 4p (every m at p = 2 and 4; at p = 8, whose checks cost the most, every remainder of
m mod p from p to 2p and the boundaries 2p +- 1, 3p, 4p - 1, 4p), in training and forward-only
evaluation. Negative control: the order the
executor had before (each message its own isend / irecv, receives posted in the senders' order
right before the pass, every send waited for at the iteration's end), written out here, hangs.
Positive control of the rules: Megatron-Core's 1F1B calls (send_forward_recv_backward and its
siblings, batched) run."""

import functools

import pytest

from epas_megatron.parallel.pipeline_p2p import (
    PENDING_SENDS,
    Exchange,
    check_plan,
    communication_plan,
    message,
    nccl_programs,
    p2p_actions,
    sends_in_flight,
)
from epas_megatron.parallel.pipeline_schedule import COMPUTE, build_schedule
from epas_megatron.runtime.p2p_rules import RECV, SEND, Call, Op, Post, Wait, WouldDeadlock, run_programs
from p2p_orders import as_rules, legacy_executor_programs

NAMES = ("1f1b", "v-1f1b", "v-half", "v-min")


def micro_batches(p: int) -> list[int]:
    """m from p to 4p: all of them at p = 2 and 4; at p = 8 (the pure model's cost grows with p and
    m) every m from p to 2p (each remainder of m mod p, the fill and drain of a short run) and the
    boundaries 2p + 1, 3p, 4p - 1, 4p."""
    if p < 8:
        return list(range(p, 4 * p + 1))
    return sorted(set(range(p, 2 * p + 2)) | {3 * p, 4 * p - 1, 4 * p})


CASES = [(name, p, m) for name in NAMES for p in (2, 4, 8) for m in micro_batches(p)]


@functools.cache
def cached_schedule(name: str, p: int, m: int):
    """build_schedule, once per case for the whole module (schedules are frozen data)."""
    return build_schedule(name, p, m)


@pytest.mark.parametrize("forward_only", [False, True], ids=["training", "forward-only"])
@pytest.mark.parametrize("name", NAMES)
def test_the_plan_runs_under_nccls_rules(name, forward_only):
    for _, p, m in (case for case in CASES if case[0] == name):
        schedule = cached_schedule(name, p, m)
        progress = check_plan(schedule, forward_only)
        sent = sum(1 for calls in progress.calls.values() for call in calls for op in call.ops if op.kind == SEND)
        expected = sum(1 for actions in p2p_actions(schedule, forward_only) for a in actions if a.kind.startswith("SEND"))
        assert sent == expected > 0


def legacy_programs(schedule):
    """The executor's issue order before the plan (tests/p2p_orders.py) as rules programs."""
    return as_rules(legacy_executor_programs(schedule), "pp")


def test_the_order_before_the_plan_hangs_on_nccl():
    """Every V schedule in training, everywhere; the issue's example (v-min, p = 2, m = 2) names
    the two sends each rank posted before the receive that matches the other's."""
    for name, p, m in CASES:
        if name != "1f1b":
            with pytest.raises(WouldDeadlock):
                run_programs(legacy_programs(cached_schedule(name, p, m)))
    with pytest.raises(WouldDeadlock) as caught:
        run_programs(legacy_programs(build_schedule("v-min", 2, 2)))
    report = str(caught.value)
    assert "rank 0: call #4 (unbatched on group pp: recv B1.0 <- 1) has not started: it is behind its own call #3 " \
           "(unbatched on group pp: send F0.1 -> 1)" in report
    assert "rank 1: call #4 (unbatched on group pp: recv F0.1 <- 0) has not started: it is behind its own call #3 " \
           "(unbatched on group pp: send B1.0 -> 0)" in report


def megatron_1f1b_programs(p: int, m: int):
    """Megatron-Core's forward_backward_pipelining_without_interleaving, as the calls it makes
    with batch_p2p_comm (each helper one batch, waited for): warm-up recv_forward / send_forward,
    steady send_forward_recv_backward / send_backward_recv_forward, cool-down recv_backward /
    send_backward."""
    programs = []
    for r in range(p):
        program, posts = [], 0

        def call(*ops):
            nonlocal posts
            ops = tuple(op for op in ops if op is not None)
            if ops:
                program.extend([Post(Call(ops, "pp")), Wait(posts)])
                posts += 1

        first, last = r == 0, r == p - 1
        recv_f = lambda i: None if first else Op(RECV, r - 1, f"F{r - 1}.{i}")  # noqa: E731
        send_f = lambda i: None if last else Op(SEND, r + 1, f"F{r}.{i}")  # noqa: E731
        recv_b = lambda i: None if last else Op(RECV, r + 1, f"B{r + 1}.{i}")  # noqa: E731
        send_b = lambda i: None if first else Op(SEND, r - 1, f"B{r}.{i}")  # noqa: E731
        warmup = min(p - r - 1, m)
        for i in range(warmup):
            call(recv_f(i))
            call(send_f(i))
        if warmup < m:
            call(recv_f(warmup))
        for k in range(m - warmup):
            f, b = warmup + k, k
            call(send_f(f), recv_b(b))
            if k == m - warmup - 1:
                call(send_b(b))
            else:
                call(send_b(b), recv_f(f + 1))
        for b in range(m - warmup, m):
            call(recv_b(b))
            call(send_b(b))
        programs.append(program)
    return programs


@pytest.mark.parametrize("p", [2, 4, 8])
def test_megatrons_own_1f1b_calls_run_under_the_rules(p):
    for m in (p, 2 * p, 4 * p):
        progress = run_programs(megatron_1f1b_programs(p, m))
        assert sum(len(calls) for calls in progress.calls.values()) > 0


@pytest.mark.parametrize("name", NAMES)
def test_each_message_is_sent_after_its_pass_and_received_before_the_pass_that_takes_it(name):
    """Structure of the plan: the sends of an exchange are those of the pass right before it, every
    message is received once, in an exchange the rank waits for, before the pass that takes it, and
    on each rank pair in the order it was sent (NCCL pairs by order)."""
    for _, p, m in (case for case in CASES if case[0] == name):
        schedule = cached_schedule(name, p, m)
        plans = communication_plan(schedule)
        sent_order, checked = {}, 0
        for rank, plan in enumerate(plans):
            for before, step in zip((None,) + plan, plan):
                if isinstance(step, Exchange):
                    for send in step.sends:
                        assert before.kind in COMPUTE and (before.stage, before.microbatch) == (send.stage, send.microbatch)
                        assert (send.kind == "SEND_F") == (before.kind == "F")
                        sent_order.setdefault((rank, send.peer), []).append(message(send))
        for rank, plan in enumerate(plans):
            have, received_order = set(), {}
            for step in plan:
                if isinstance(step, Exchange):
                    assert step.waits or not step.receives
                    for receive in step.receives:
                        assert message(receive) not in have
                        have.add(message(receive))
                        received_order.setdefault((receive.peer, rank), []).append(message(receive))
                elif step.kind in ("F", "B", "BW"):
                    needed = [a for a in schedule.p2p_lists[rank] if a.kind.startswith("RECV")
                              and (a.kind == "RECV_F") == (step.kind == "F")
                              and (a.stage + (1 if a.kind == "RECV_F" else -1), a.microbatch) == (step.stage, step.microbatch)]
                    for receive in needed:
                        assert message(receive) in have, f"{name} p={p} m={m}: {step} before its receive"
                        checked += 1
            for pair, order in received_order.items():
                assert order == sent_order[pair]
        assert checked == sum(1 for actions in schedule.p2p_lists for a in actions if a.kind.startswith("RECV"))


def test_sends_in_flight_by_hand():
    """1F1B at p = 4, rank 0: F0.0 goes out and stays pending over F0.1; F0.1's exchange would
    leave two pending, so it waits (holding both meanwhile); F0.2 pending, then F0.3's exchange
    receives B1.0 and waits: two at most. The last rank receives before every pass: one. Every
    schedule stays within one more than PENDING_SENDS."""
    assert PENDING_SENDS == 1
    assert sends_in_flight(build_schedule("1f1b", 4, 16)) == (2, 1, 1, 1)
    assert sends_in_flight(build_schedule("1f1b", 4, 16), forward_only=True) == (2, 1, 1, 0)
    plan = communication_plan(build_schedule("1f1b", 4, 16))[0]
    exchanges = [step for step in plan if isinstance(step, Exchange)][:4]
    assert [(tuple(map(message, e.sends)), tuple(map(message, e.receives)), e.waits) for e in exchanges] == [
        (("F0.0",), (), False), (("F0.1",), (), True), (("F0.2",), (), False), (("F0.3",), ("B1.0",), True)]
    for name, p, m in CASES:
        assert max(sends_in_flight(cached_schedule(name, p, m))) <= PENDING_SENDS + 1


def test_nccl_programs_wait_for_every_post_at_the_end():
    programs = nccl_programs(build_schedule("v-min", 2, 2))
    for program in programs:
        posts = sum(isinstance(step, Post) for step in program)
        assert [step.index for step in program[-posts:]] == list(range(posts))
