"""The project's pipeline executor (engine/pipeline_executor.py) running action lists against
Megatron-Core's own 1F1B schedule (two gloo ranks, PP=2): bit for bit."""

from pathlib import Path

import pytest

from epas_testing import json_lines, run_script

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    proc = run_script(Path(__file__).parent / "scripts" / "executor_1f1b.py", nproc=2, timeout=600)
    return {row["case"]: row for row in json_lines(proc.stdout, "RESULT")}


@pytest.mark.parametrize("case", ["plain", "handoff", "handoff_bf16"])
def test_the_1f1b_lists_equal_megatrons_1f1b_bit_for_bit(results, case):
    """Losses and gradient norms of three iterations, every parameter after them on both ranks,
    and a forward-only step: equal as floats -- with the EPAS hand-off in the p2p tensor (the
    region crosses the stage boundary) and in bf16."""
    row = results[case]
    assert row["ours"] == row["megatron"]
    assert row["valid"][0] == row["valid"][1]
    assert row["same_params_per_rank"] == [True, True], row["max_param_diff_per_rank"]


def test_any_valid_order_runs_and_the_region_is_real(results):
    """GPipe's order (all forwards, then all backwards) gives the same step (the gradients are
    accumulated in the same micro-batch order); the hand-off region changes the numbers."""
    gpipe = results["handoff_gpipe_order"]
    assert gpipe["ours"] == gpipe["megatron"] and gpipe["same_params_per_rank"] == [True, True]
    assert results["handoff"]["megatron"][0][0] != results["plain"]["megatron"][0][0]
