"""The executor's timeline recorder (engine/pipeline_executor.py, ``record_timelines``) on a
real two-rank run (gloo, PP=2), 1F1B and V-Half: the bubble recomputed by hand from the recorded
start and end times, the p2p bytes against a hand count (messages x tensor shape x 4 bytes), and
a run with the recorder on equal bit for bit to one with it off."""

from pathlib import Path

import pytest

from epas_testing import json_lines, run_script

pytestmark = pytest.mark.distributed

SEQ, BATCH, HIDDEN, M, ITERATIONS = 32, 2, 64, 4, 3  # tests/executor_runs.py; the script's model
MESSAGE_BYTES = SEQ * BATCH * HIDDEN * 4  # one [s, b, h] fp32 activation or gradient (no hand-off rows: no sharing)


@pytest.fixture(scope="module")
def results():
    proc = run_script(Path(__file__).parent / "scripts" / "executor_timeline.py", nproc=2, timeout=600)
    return {row["schedule"]: row for row in json_lines(proc.stdout, "RESULT")}


@pytest.mark.parametrize("schedule", ["1f1b", "v-half"])
def test_recording_changes_nothing(results, schedule):
    """Losses, gradient norms, the forward-only loss and every parameter on both ranks: equal as
    floats with and without the recorder."""
    row = results[schedule]
    assert row["on"] == row["off"] and row["valid"][0] == row["valid"][1]
    assert row["same_params_per_rank"] == [True, True]


@pytest.mark.parametrize("schedule", ["1f1b", "v-half"])
def test_the_bubble_is_the_recorded_times_idle_share(results, schedule):
    """Per iteration (three training steps, one forward-only), by hand from the raw times: each
    rank's busy time is the sum of its actions' durations, its span from its first start to its
    last end; the bubble is ``1 - busy / span`` of the rank with the longest span (the simulation's
    definition). The recorded actions are the schedule's compute lists, in order, one after the
    other (forward-only steps: the forwards alone)."""
    row = results[schedule]
    assert len(row["bubbles"]) == ITERATIONS + 1
    for i, bubble in enumerate(row["bubbles"]):
        spans, busy = [], []
        for rank, timelines in enumerate(row["timelines"]):
            t = timelines[i]
            expected = [a for a in row["lists"][rank] if i < ITERATIONS or a.startswith("F")]
            assert t["actions"] == expected
            assert all(e >= s for s, e in zip(t["start"], t["end"]))
            assert all(nxt >= end for end, nxt in zip(t["end"], t["start"][1:]))  # one action at a time
            spans.append(t["end"][-1] - t["start"][0])
            busy.append(sum(e - s for s, e in zip(t["start"], t["end"])))
            assert t["bubble"] == pytest.approx(1 - busy[-1] / spans[-1], abs=1e-12)
        longest = max(range(2), key=lambda r: spans[r])
        assert bubble == pytest.approx(1 - busy[longest] / spans[longest], abs=1e-12)
        assert 0 <= bubble < 1


def test_p2p_bytes_are_the_hand_count(results):
    """Messages per rank and iteration, counted by hand: 1F1B's rank 0 sends each micro-batch's
    activations to rank 1, rank 1 each gradient back (M each); under V placement every rank sends
    twice that -- rank 0 its chunk 0's activations and its chunk 1's input gradients (stage 3 ->
    2), rank 1 its chunk 1's activations (stage 2 -> 3) and chunk 0's input gradients (1 -> 0). A
    forward-only step sends the activations alone: 1F1B rank 0 M, rank 1 none; V M each. Every
    message is one [s, b, h] fp32 tensor."""
    hand = {"1f1b": ([M, M], [M, 0]), "v-half": ([2 * M, 2 * M], [M, M])}
    for schedule, (train, forward_only) in hand.items():
        for rank, timelines in enumerate(results[schedule]["timelines"]):
            for i, t in enumerate(timelines):
                messages = train[rank] if i < ITERATIONS else forward_only[rank]
                received = train[1 - rank] if i < ITERATIONS else forward_only[1 - rank]
                assert (t["sent_messages"], t["sent_bytes"]) == (messages, messages * MESSAGE_BYTES), (schedule, rank, i)
                assert (t["received_messages"], t["received_bytes"]) == (received, received * MESSAGE_BYTES), (schedule, rank, i)
