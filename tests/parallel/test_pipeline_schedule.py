"""Pipeline schedules as data (parallel/pipeline_schedule.py), tested without processes: every
action exactly once on its stage's rank, each rank's order and the cross-rank dependencies
(the simulation runs to the end), peak activations and bubbles against the paper's figures
(Qi et al., NeurIPS 2024) and hand-computed 1F1B, the simulator's peak against an independent
count over each rank's list, and the sends and receives."""

import itertools

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.parallel.pipeline_schedule import (
    PIPELINE_SCHEDULES,
    Action,
    ScheduleFacts,
    build_schedule,
    channel_orders,
    check_actions,
    depends_on,
    paper_peak,
    pipeline_schedule,
    v_chunk,
    v_rank,
    with_p2p,
)
from epas_megatron.parallel.schedule_simulation import PassCosts, peak_in_flight, rank_peak_bytes, simulate

NAMES = ("1f1b", "v-1f1b", "v-half", "v-min")
CASES = [(name, p, m) for name in NAMES for p in (2, 4, 8) for m in range(p, 4 * p + 1)]


@pytest.mark.parametrize("name", NAMES)
def test_every_action_once_in_order_and_the_lists_run_to_the_end(name):
    for _, p, m in (case for case in CASES if case[0] == name):
        schedule = build_schedule(name, p, m)
        check_actions(schedule)
        passes = 3 if schedule.split_backward else 2
        assert sum(map(len, schedule.ranks)) == passes * schedule.stages * m
        sim = simulate(schedule)  # raises if the lists deadlock
        assert len(sim.end) == passes * schedule.stages * m
        for action, start in sim.start.items():  # every action after the one it waits for
            needed = depends_on(schedule, action)
            assert needed is None or sim.end[needed] <= start


def test_check_actions_catches_what_it_is_for():
    good = build_schedule("v-half", 4, 4)
    ranks = [list(actions) for actions in good.ranks]
    twice = [actions[:] for actions in ranks]
    twice[0].append(twice[0][0])
    missing = [actions[:] for actions in ranks]
    missing[1].pop()
    wrong_rank = [actions[:] for actions in ranks]
    wrong_rank[0].append(wrong_rank[1].pop())
    w_first = [actions[:] for actions in ranks]
    b = next(i for i, a in enumerate(w_first[2]) if a.kind == "B")
    w = next(i for i, a in enumerate(w_first[2]) if a.kind == "W" and a.stage == w_first[2][b].stage and
             a.microbatch == w_first[2][b].microbatch)
    w_first[2][b], w_first[2][w] = w_first[2][w], w_first[2][b]
    for broken, message in ((twice, "twice"), (missing, "never run"), (wrong_rank, "its stage on rank"), (w_first, "before")):
        with pytest.raises(ValueError, match=message):
            check_actions(type(good)(good.name, good.pp, good.microbatches, tuple(map(tuple, broken))))


def test_a_deadlocked_order_is_refused_by_the_simulation():
    """Rank 0 waiting for a backward that rank 1 can only run after rank 0's next forward."""
    good = build_schedule("1f1b", 2, 2)
    rank0 = (Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1), Action("BW", 0, 1))
    rank1 = (Action("F", 1, 0), Action("F", 1, 1), Action("BW", 1, 0), Action("BW", 1, 1))
    with pytest.raises(ValueError, match="deadlock"):
        simulate(type(good)("1f1b", 2, 2, (rank0, rank1)))


def test_v_placement():
    assert [v_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [v_chunk(s, 4) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    schedule = build_schedule("v-min", 4, 4)
    assert {a.stage for a in schedule.ranks[0]} == {0, 7}  # embedding and loss on rank 0
    assert {a.stage for a in schedule.ranks[3]} == {3, 4}  # the turn


def held_by_order(actions) -> int:
    """Peak chunk-passes held, counted along a rank's list alone (no times): +1 at a forward,
    -1 at the end of a W (or BW). A rank runs its list one action at a time, so this equals
    the peak over time -- an independent count of what the simulation measures."""
    held = peak = 0
    for action in actions:
        held += {"F": 1, "W": -1, "BW": -1}.get(action.kind, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name, p, m", CASES)
def test_peak_activations(name, p, m):
    """In micro-batches of a whole rank's layers (two chunks under V placement): 1F1B keeps
    ``p - r`` on rank ``r``; V-Half the paper's ``(p + 2) // 2`` and V-Min ``(p + 4) // 3`` on its
    busiest rank, and from p = 4 every rank at least 70 % of that; v-1f1b three quarters of 1F1B (rounded up to a
    chunk) from ``p = 4`` on -- at ``p = 2`` its 2, 1F1B's."""
    schedule = build_schedule(name, p, m)
    sim = simulate(schedule)
    assert sim.peak_chunks == [held_by_order(actions) for actions in schedule.ranks]
    peak = max(sim.peak_in_flight)
    if name == "1f1b":
        assert sim.peak_in_flight == [min(p - r, m) for r in range(p)]
    elif name == "v-1f1b" and p == 2:
        assert peak == 2
    else:
        assert peak == paper_peak(name, p) or (name == "v-half" and m == p == 2 and peak < paper_peak(name, p))
        if p > 2:  # V placement evens the ranks out (1F1B: 1 against p)
            assert min(sim.peak_in_flight) >= 0.7 * peak
    assert {"1f1b": 8, "v-1f1b": 6, "v-half": 5, "v-min": 4}[name] == paper_peak(name, 8)


def bytes_by_order(actions, stage_bytes) -> float:
    """Peak bytes along a rank's list alone: a forward adds its stage's ``full``, a ``B`` gives
    back all but ``deferred``, a ``W`` the ``deferred``, a ``BW`` the ``full``."""
    held = peak = 0.0
    for action in actions:
        full, deferred = stage_bytes[action.stage]
        held += {"F": full, "B": deferred - full, "W": -deferred, "BW": -full}[action.kind]
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("name", NAMES)
def test_weighed_peaks_equal_a_count_along_each_list(name):
    """``simulate(stage_bytes=...)``: each pass weighed by its stage's bytes before and after its
    B, with other costs (B twice F, W half of it), against the count along each rank's list."""
    for _, p, m in (case for case in CASES if case[0] == name and case[1] in (2, 4) and case[2] in (case[1], 2 * case[1])):
        schedule = build_schedule(name, p, m)
        stage_bytes = {s: (100.0 + 7 * s, 30.0 + s) for s in range(schedule.stages)}
        sim = simulate(schedule, PassCosts(1.0, 2.0, 0.5), stage_bytes=stage_bytes)
        assert sim.peak_bytes == [bytes_by_order(actions, stage_bytes) for actions in schedule.ranks]
        assert sim.peak_bytes == [rank_peak_bytes(schedule, r, stage_bytes) for r in range(p)]
        assert list(peak_in_flight(name, p, m)) == sim.peak_in_flight
        assert simulate(schedule).peak_bytes == []
        # counted whole (deferred = full), the peak is the chunk count's
        whole = simulate(schedule, stage_bytes={s: (1.0, 1.0) for s in range(schedule.stages)})
        assert whole.peak_bytes == whole.peak_chunks


def test_one_f_one_b_by_hand():
    """p = 2, m = 3, F = 1, BW = 2 (B + W): rank 1 runs F0 at 1, BW0 2-4, F1 4, BW1 5-7, F2 7,
    BW2 8-10; rank 0 F0 0, F1 1, waits for BW0's gradient (4), BW0 4-6, F2 6, BW1 7-9, BW2 10-12.
    The bubble is (p - 1)(F + B + W) = 3 on the longest rank (rank 0: 12 against 9 of work)."""
    sim = simulate(build_schedule("1f1b", 2, 3))
    start = {str(a): t for a, t in sim.start.items()}
    assert [start[k] for k in ("F1.0", "BW1.0", "F1.1", "BW1.1", "F1.2", "BW1.2")] == [1, 2, 4, 5, 7, 8]
    assert [start[k] for k in ("F0.0", "F0.1", "BW0.0", "F0.2", "BW0.1", "BW0.2")] == [0, 1, 4, 6, 7, 10]
    assert sim.makespan == 12 and sim.bubble_time == 3 and sim.bubble == pytest.approx(3 / 12)


def test_stage_costs_by_hand():
    """Stages of unequal work (``stage_costs``): 1F1B, p = 2, m = 3, stage 0 F = B = W = 1, stage 1
    F = B = W = 2 (BW 4). Rank 0: F0.0 0-1, F0.1 1-2; rank 1: F1.0 1-3, BW1.0 3-7, F1.1 7-9,
    BW1.1 9-13; rank 0: BW0.0 7-9, F0.2 9-10, BW0.1 13-15; rank 1: F1.2 13-15, BW1.2 15-19;
    rank 0: BW0.2 19-21. Rank 1 is never idle after its start; the longest rank, 0, works 9 of 21."""
    sim = simulate(build_schedule("1f1b", 2, 3), stage_costs={0: PassCosts(1, 1, 1), 1: PassCosts(2, 2, 2)})
    start = {str(a): t for a, t in sim.start.items()}
    assert [start[k] for k in ("F1.0", "BW1.0", "F1.1", "BW1.1", "F1.2", "BW1.2")] == [1, 3, 7, 9, 13, 15]
    assert [start[k] for k in ("F0.0", "F0.1", "BW0.0", "F0.2", "BW0.1", "BW0.2")] == [0, 1, 7, 9, 13, 19]
    assert sim.makespan == 21 and sim.busy == [9, 18] and sim.bubble == pytest.approx(1 - 9 / 21)
    for name in NAMES:  # equal stage costs given per stage: as the costs per rank, halved under V
        schedule = build_schedule(name, 4, 8)
        per_stage = PassCosts(1.5 / schedule.chunks_per_rank, 2 / schedule.chunks_per_rank, 1 / schedule.chunks_per_rank)
        ours = simulate(schedule, stage_costs={s: per_stage for s in range(schedule.stages)})
        assert ours.makespan == pytest.approx(simulate(schedule, PassCosts(1.5, 2, 1)).makespan)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubbles_against_1f1b(p):
    """Idle time of the longest rank, F = B = W, the same work per rank (a V stage is half a
    rank's layers): 1F1B's is ``(p - 1)(F + B + W)``; the paper's V-Half has about half of it
    (~p/2m against ~p/m) and V-Min two thirds (~2p/3m); 1F1B-V 1F1B's. Measured here: V-Half
    0.50-0.57 (0.67 at p = m = 2), V-Min 0.50-0.64, v-1f1b 1.00-1.02 (1.17 at p = 2), for every m
    from p to 4p."""
    for m in range(p, 4 * p + 1):
        base = simulate(build_schedule("1f1b", p, m))
        assert base.bubble_time == pytest.approx(3 * (p - 1))
        ratio = {name: simulate(build_schedule(name, p, m)).bubble_time / base.bubble_time for name in NAMES[1:]}
        assert 0.45 <= ratio["v-half"] <= (0.67 if m == p == 2 else 0.6), (m, ratio)
        assert 0.45 <= ratio["v-min"] <= 0.7, (m, ratio)
        assert ratio["v-1f1b"] <= (1.05 if p > 2 else 1.2), (m, ratio)


def test_other_costs_keep_the_lists_running_and_the_peaks():
    """Other costs than unit ones (B 1.3 F, W 0.9 F, a link of 0.2 F): the same lists run to the
    end with the same peaks (held along each list). V-Half's bubble stays below 1F1B's (the paper:
    V-Half stays nearly bubble-free while W + 2B >= 2F and W + 2F >= 2B); V-Min's does not
    (measured 1.5x 1F1B's at p = 4 and 8: its tight blocks leave no slack for B > F)."""
    costs = PassCosts(forward=1.0, input_grad=1.3, weight_grad=0.9, p2p=0.2)
    for name, p in itertools.product(NAMES, (4, 8)):
        schedule = build_schedule(name, p, 2 * p)
        sim = simulate(schedule, costs)
        assert sim.peak_chunks == [held_by_order(actions) for actions in schedule.ranks]
        base = simulate(build_schedule("1f1b", p, 2 * p), costs).bubble_time
        if name == "v-half":
            assert sim.bubble_time < 0.9 * base
        if name == "v-min":
            assert sim.bubble_time > base


@pytest.mark.parametrize("name", NAMES)
def test_sends_and_receives(name):
    """Every cross-rank dependency is one send after the producing pass and one receive before
    the consuming one, on the two ranks; the turn on rank p - 1 (V placement) needs none. The
    split schedules and 1F1B send on every rank pair in the order the receiver takes them
    (an in-order transport such as NCCL's suffices); v-1f1b does not (its runtime must post
    receives in the senders' order)."""
    p, m = 4, 8
    schedule = build_schedule(name, p, m)
    lists = with_p2p(schedule)
    every = [(r, a) for r, actions in enumerate(lists) for a in actions]
    sends = [(r, a.peer, a.kind[-1], a.stage, a.microbatch) for r, a in every if a.kind.startswith("SEND")]
    recvs = [(a.peer, r, a.kind[-1], a.stage, a.microbatch) for r, a in every if a.kind.startswith("RECV")]
    assert sorted(sends) == sorted(recvs)
    boundaries = (schedule.stages - 1) - (1 if schedule.v_placement else 0)  # stage boundaries between ranks
    assert len(sends) == 2 * boundaries * m
    for rank, actions in enumerate(lists):
        for i, action in enumerate(actions):
            if action.kind.startswith("RECV"):
                consumer = actions[i + 1]
                assert consumer.microbatch == action.microbatch and depends_on(schedule, consumer).stage == action.stage
    in_order = all(sent == received for sent, received in channel_orders(schedule).values())
    assert in_order == (name != "v-1f1b")


@pytest.mark.parametrize("argv, message", [
    (("v-half", 1, 4, None), "needs --pp >= 2"),
    (("v-min", 4, 3, None), "needs at least 4 micro-batches per iteration, got 3: raise --global-batch-size"),
    (("v-1f1b", 4, 8, 2), "drop --vpp 2"),
    (("zb", 4, 8, None), "choose one of 1f1b, interleaved, v-1f1b, v-half, v-min"),
])
def test_refusals_name_the_flag(argv, message):
    name, pp, microbatches, vpp = argv
    with pytest.raises(ConfigError, match=message):
        pipeline_schedule(name).check(ScheduleFacts(pp, microbatches, vpp))
    pipeline_schedule("1f1b").check(ScheduleFacts(1, 1))  # today's default needs nothing new


def test_a_schedule_is_one_object_with_every_refusal():
    """What each --pipeline-schedule is, by hand, and every refusal at once (epas-plan lists them
    all; the run's validation raises the first)."""
    kinds = {name: (kind.placement, kind.split_backward, kind.executor, kind.chunks_per_rank(3))
             for name, kind in PIPELINE_SCHEDULES.items()}
    assert kinds == {"1f1b": ("stages", False, False, 3), "interleaved": ("interleaved", False, False, 3),
                     "v-1f1b": ("v", False, True, 2), "v-half": ("v", True, True, 2), "v-min": ("v", True, True, 2)}
    facts = ScheduleFacts(pp=4, microbatches=3, vpp=None, num_layers=6, tied_embeddings=True, overlap_grad_reduce=True,
                          backend="transformer_engine")
    refusals = pipeline_schedule("v-min").refusals(facts)
    assert len(refusals) == 5 and all(r.startswith("--pipeline-schedule v-min") for r in refusals), refusals
    for needle, refusal in zip(["at least 4 micro-batches", "--transformer-impl local", "--no-untie-embeddings",
                                "--overlap-grad-reduce", "--num-layers 6 is too few"], refusals):
        assert needle in refusal
    assert len(pipeline_schedule("v-1f1b").refusals(facts)) == 4  # no split backward: TE runs it
    assert pipeline_schedule("1f1b").refusals(facts) == []
    assert pipeline_schedule("interleaved").refusals(facts) == ["--pipeline-schedule interleaved needs --vpp >= 2 "
                                                               "(or an interleaved --pipeline-layout)"]
    assert str(pipeline_schedule("v-half")) == "v-half" and build_schedule("v-half", 2, 2).kind is PIPELINE_SCHEDULES["v-half"]
