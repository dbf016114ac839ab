"""epas-bench pipeline --schedule: a two-rank run on the tiny model (the table's invariants; speed
not asserted) and the predicted 7B table against hand numbers."""

import json
import subprocess
import sys

import pytest

from epas_testing import REPO

SEQ, MBS, M, ITERS, WARMUP = 32, 2, 4, 2, 1


@pytest.mark.distributed
def test_two_rank_bench_keeps_the_tables_invariants():
    """Every schedule trains the same model on the same tokens: the losses of all steps agree to
    fp32 rounding (1F1B here is Megatron-Core's 1F1B bit for bit: tests/training/test_pipeline_executor.py).
    The p2p traffic follows the message count by hand: at p = 2, 1F1B's ranks each send M
    messages per iteration (activations down, gradients back), every V schedule's 2M (both
    chunks' activations and input gradients); the region (layers 2-3) crosses a boundary under
    both placements, so every message has the same hand-off rows and V sends exactly twice the
    bytes. Memory is measured on every rank, bubbles are idle shares."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "epas_megatron.bench.cli", "pipeline", "--schedule", "1f1b", "v-1f1b", "v-half", "v-min",
                           "--preset", "tiny", "--region", "2", "--iters", str(ITERS), "--warmup", str(WARMUP),
                           "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--num-microbatches", str(M)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([line for line in proc.stdout.splitlines() if line.startswith("BENCH ")][-1][6:])
    rows = {row["schedule"]: row for row in record["schedules"]}
    assert list(rows) == ["1f1b", "v-1f1b", "v-half", "v-min"]
    steps = WARMUP + 1 + ITERS
    reference = rows["1f1b"]["losses"]
    assert len(reference) == steps
    for name, row in rows.items():
        assert row["losses"] == pytest.approx(reference, rel=1e-5), name
        assert row["p2p_sent_messages_per_rank"] == ([M, M] if name == "1f1b" else [2 * M, 2 * M]), name
        assert row["p2p_received_bytes_per_rank"] == row["p2p_sent_bytes_per_rank"][::-1], name
        assert all(peak > 0 for peak in row["peak_bytes_per_rank"]), name
        assert 0 <= row["bubble_executed"] < 1 and row["seconds_per_iteration"] > 0, name
    message = rows["1f1b"]["p2p_sent_bytes_per_rank"][0] // M
    assert message >= SEQ * MBS * 64 * 4  # at least [s, b, h] fp32 (plus the hand-off rows)
    for name in ("v-1f1b", "v-half", "v-min"):
        assert rows[name]["p2p_sent_bytes_per_rank"] == [2 * b for b in rows["1f1b"]["p2p_sent_bytes_per_rank"]]
    assert record["losses_agree"] is True
    assert "MEASURED (CPU: memory and correctness, not speed)" in proc.stdout
    assert "PREDICTED, not measured" in proc.stdout


def test_predicted_table_against_hand_numbers():
    """7B (32 layers, h 4096, MHA, F 11008, s 2048, micro-batch 1, bf16), m = 4p. Without p2p
    cost, 1F1B idles ``(p - 1)(F + B)`` of ``(m + p - 1)(F + B)`` on every rank: bubble
    ``(p - 1) / (m + p - 1)``. Peak in-flight micro-batches on the busiest rank: the paper's (1F1B
    p; V-Half 3 at p = 4, 5 at p = 8; V-Min 2 and 4; 1F1B-V 3 and 6). P2P: 1F1B's end ranks send m
    messages, its middle ranks 2m, V ranks twice that, each ``s x h`` bf16 (16 MiB)."""
    from epas_megatron.bench.schedule_bench import predicted_rows

    rows = {(r["p"], r["schedule"]): r for r in predicted_rows(p2p_flops_per_byte=0.0)}
    paper = {4: {"1f1b": 4, "v-1f1b": 3, "v-half": 3, "v-min": 2}, 8: {"1f1b": 8, "v-1f1b": 6, "v-half": 5, "v-min": 4}}
    message_gib = 2048 * 4096 * 2 / 2**30
    for p, peaks in paper.items():
        m = 4 * p
        assert rows[(p, "1f1b")]["bubble"] == pytest.approx((p - 1) / (m + p - 1))
        assert rows[(p, "1f1b")]["time_vs_1f1b"] == 1.0
        one = [m] + [2 * m] * (p - 2) + [m]
        for name, peak in peaks.items():
            assert rows[(p, name)]["peak_in_flight"] == peak, (p, name)
            factor = 1 if name == "1f1b" else 2
            assert rows[(p, name)]["p2p_gib_per_rank"] == pytest.approx([factor * n * message_gib for n in one]), (p, name)
        assert rows[(p, "v-min")]["activations_gib"] < rows[(p, "1f1b")]["activations_gib"]


def test_modelled_pass_costs_by_hand():
    """One 7B layer, s 2048, causal halving: the GEMMs (Q, K, V, output: 4 x 2·s·h², MLP
    3 x 2·s·h·F) and the attention core (two s² matmuls, 2·s²·h each, halved); F = GEMMs + core,
    B = GEMMs + 2 x core, W = GEMMs; a message s·h bf16 bytes."""
    from epas_megatron.bench.schedule_bench import modelled_pass_costs
    from epas_megatron.config.presets import get_preset
    from epas_megatron.model.architecture import ModelShape, architecture_from_preset

    s, h, f = 2048, 4096, 11008
    gemms, core = 4 * 2 * s * h * h + 3 * 2 * s * h * f, 2 * s * s * h
    costs = modelled_pass_costs(ModelShape(architecture_from_preset(get_preset("7b")), s), layers_per_rank=8, p2p_flops_per_byte=10.0)
    assert (costs.forward, costs.input_grad, costs.weight_grad) == (8 * (gemms + core), 8 * (gemms + 2 * core), 8 * gemms)
    assert costs.p2p == s * h * 2 * 10.0


def test_replay_with_per_stage_costs_by_hand():
    """1F1B, p = 2, m = 2, the last stage twice as slow (F 2, BW 4; stage 0: F 1, BW 2). By hand:
    rank 0 runs F0.0 [0, 1], F0.1 [1, 2], then waits for rank 1's backwards: BW0.0 [7, 9], BW0.1
    [13, 15]; rank 1 runs F1.0 [1, 3], BW1.0 [3, 7], F1.1 [7, 9], BW1.1 [9, 13]. Rank 0 has the
    longest span (15) and is busy 6 of it: bubble 0.6. With uniform costs the replay is the
    simulation's unit-cost bubble (every schedule, p = 4, m = 8)."""
    from epas_megatron.bench.schedule_bench import replay
    from epas_megatron.parallel.pipeline_schedule import build_schedule
    from epas_megatron.parallel.schedule_simulation import PassCosts, simulate

    costs = {("F", 0): 1.0, ("BW", 0): 2.0, ("F", 1): 2.0, ("BW", 1): 4.0}
    bubble, busy, span = replay(build_schedule("1f1b", 2, 2), lambda a: costs[(a.kind, a.stage)])
    assert (bubble, busy, span) == (pytest.approx(0.6), [6.0, 12.0], [15.0, 12.0])
    for name in ("1f1b", "v-1f1b", "v-half", "v-min"):
        schedule = build_schedule(name, 4, 8)
        # simulate prices a V stage's pass at half a rank's (two chunks per rank); BW = B + W
        per_action = lambda a: PassCosts().of(a.kind) / schedule.chunks_per_rank  # noqa: E731
        assert replay(schedule, per_action)[0] == pytest.approx(simulate(schedule).bubble), name
