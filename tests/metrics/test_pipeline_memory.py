"""Measured against modelled: the activation bytes each pipeline rank keeps for backward through a
real iteration of 1f1b, v-1f1b, v-half and v-min on four gloo ranks (the executor;
tests/training/scripts/executor_memory.py, measured with metrics/activation_memory.LiveSavedBytes)
against the memory model's per-rank peak (metrics/rank_memory.rank_memory_bytes: the layers',
embedding's and head's terms, each pass weighed along the rank's action list by what it holds
before and after its input-gradient backward). The model is never fitted to the measurement: its
terms are the per-layer ones measured byte for byte in tests/metrics/test_activation_memory.py
plus the weight-gradient terms of weight_grad_terms (the deferred GEMMs' operands)."""

import pytest

from epas_megatron.metrics.rank_memory import RankMemorySettings, rank_memory_bytes, sent_messages_held
from epas_megatron.parallel.pipeline_p2p import sends_in_flight
from epas_megatron.parallel.pipeline_schedule import build_schedule, paper_peak
from epas_megatron.parallel.schedule_simulation import simulate
from epas_testing import REPO, json_lines, model_shape, run_script


@pytest.fixture(scope="module")
def measured():
    proc = run_script(REPO / "tests" / "training" / "scripts" / "executor_memory.py", nproc=4, timeout=600)
    return {row["schedule"]: row for row in json_lines(proc.stdout, "RESULT")}


def modelled(row, weighed=True):
    """Per rank: the model's peak activation bytes for the run ``row`` describes (one layer per
    V stage, fp32, no sharing); ``weighed=False``: every pass held whole to the end of its W."""
    shape = model_shape(row["layers"], row["hidden_size"], row["num_attention_heads"], row["num_query_groups"],
                        row["ffn_hidden_size"], row["vocab_size"], row["seq"], row["batch"])
    p, name = row["pp"], row["schedule"]
    settings = RankMemorySettings(num_microbatches=row["microbatches"], pipeline_schedule=name)
    roles = [["compute"], ["compute"]] if name != "1f1b" else [["compute", "compute"]]
    out = []
    for rank in range(p):
        if weighed:
            out.append(rank_memory_bytes(shape, roles, rank, p, 1, settings)["activations"])
        else:
            units = simulate(build_schedule(name, p, row["microbatches"])).peak_in_flight[rank]
            out.append(rank_memory_bytes(shape, roles, rank, p, 1, settings, in_flight=units)["activations"])
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "v-1f1b", "v-half", "v-min"])
def test_measured_peaks_equal_the_model_within_5_percent(measured, schedule):
    """Every rank within 5% (measured: at most +1.0%, the first output gradient a split B holds
    before it releases the pass's other tensors; 1F1B and v-1f1b to 0.003%), nothing held after
    the iteration, and the busiest rank's peak in the paper's units (Qi et al., NeurIPS 2024):
    1F1B ``p`` on rank 0, v-1f1b 3/4 of it, V-Half ``(p + 2) // 2``, V-Min ``(p + 4) // 3``."""
    row = measured[schedule]
    predicted = modelled(row)
    for rank, (got, want) in enumerate(zip(row["peak_per_rank"], predicted)):
        assert abs(got / want - 1) < 0.05, (schedule, rank, got, want)
    assert row["left_per_rank"] == [0] * row["pp"]
    units = simulate(build_schedule(schedule, row["pp"], row["microbatches"])).peak_in_flight
    assert max(units) == paper_peak(schedule, row["pp"]) == {"1f1b": 4, "v-1f1b": 3, "v-half": 3, "v-min": 2}[schedule]
    if schedule == "1f1b":  # rank r keeps p - r micro-batches: the whole-rank formula, to the byte
        # (the last rank also holds the 4-byte loss scale its B multiplies the loss by; rank 0 the
        # 16 bytes by which a token batch's storage -- a view of s + 1 tokens -- exceeds s tokens)
        assert row["peak_per_rank"][1:] == [round(v) for v in predicted[1:-1]] + [round(predicted[-1]) + 4]
        assert row["peak_per_rank"][0] == round(predicted[0]) + 16 * 4


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["1f1b", "v-1f1b", "v-half", "v-min"])
def test_sent_messages_are_held_no_longer_than_the_plan_names(measured, schedule):
    """p = 4, m = 4p: a sent stage output lives until the executor drops its send's ``Work``.
    Each rank holds at most the messages its communication plan names (``sends_in_flight``: two
    at most; for the V schedules what the memory model counts, ``sent_messages_held``), and its
    saved and sent bytes together stay within the model's activations plus those messages. (The
    executor before the plan kept every send to the iteration's end: 2m messages on rank 0 here.)"""
    row = measured[schedule]
    p, m, message = row["pp"], row["microbatches"], row["message_bytes"]
    assert m == 4 * p
    named = sends_in_flight(build_schedule(schedule, p, m))
    if schedule != "1f1b":  # the trainer's 1f1b is Megatron-Core's own schedule, the model's too
        assert list(named) == [sent_messages_held(schedule, rank, p, m) for rank in range(p)]
    for rank, (sent, both, activations) in enumerate(zip(row["sent_peak_per_rank"], row["both_peak_per_rank"], modelled(row))):
        assert message <= sent <= named[rank] * message, (schedule, rank, sent, named[rank])
        assert both <= 1.05 * activations + named[rank] * message, (schedule, rank, both, activations)


@pytest.mark.distributed
def test_the_split_backwards_lighter_phase_matters(measured):
    """Counting a V-Min pass whole until its W over-predicts rank 2 by more than 5%: between B
    and W a pass keeps only its linears' inputs and output gradients (about 60% of a layer's
    activations here), which the weighed model counts."""
    row = measured["v-min"]
    whole = modelled(row, weighed=False)
    assert whole[2] / row["peak_per_rank"][2] > 1.05
    assert all(w >= m for w, m in zip(whole, modelled(row)))


def table(rows) -> str:
    """The measured-vs-modelled table (markdown) of the script's RESULT rows."""
    lines = ["| schedule | paper's peak (units) | rank | measured KiB | modelled KiB | difference | in flight: weighed "
             "(simulated units) | units x a rank's micro-batch vs measured |", "|---|---|---|---|---|---|---|---|"]
    for name in ("1f1b", "v-1f1b", "v-half", "v-min"):
        row = rows[name]
        units = simulate(build_schedule(name, row["pp"], row["microbatches"])).peak_in_flight
        for rank, (got, want, whole) in enumerate(zip(row["peak_per_rank"], modelled(row), modelled(row, weighed=False))):
            lines.append(f"| {name} | {paper_peak(name, row['pp']):g} | {rank} | {got / 1024:.1f} | {want / 1024:.1f} | "
                         f"{100 * (got / want - 1):+.2f}% | {want / whole * units[rank]:.2f} ({units[rank]:g}) | "
                         f"{100 * (whole / got - 1):+.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":  # PYTHONPATH=tests python tests/metrics/test_pipeline_memory.py [P]: the table at P ranks
    import sys

    p = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    proc = run_script(REPO / "tests" / "training" / "scripts" / "executor_memory.py", [str(p)], nproc=p, timeout=1800)
    print(table({row["schedule"]: row for row in json_lines(proc.stdout, "RESULT")}))
