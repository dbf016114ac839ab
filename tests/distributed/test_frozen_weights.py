"""DP=2 with overlapped gradient reduction: frozen Q/K weights are outside the optimizer and the
gradient buckets (no all-reduce, no hang), and never move after their switch."""

import json
from pathlib import Path

import pytest

from epas_testing import TINY, run_script

pytestmark = pytest.mark.distributed


def test_frozen_weights_are_outside_optimizer_and_gradient_reduction(tmp_path):
    args = [*TINY, "--train-iters", "8", "--global-batch-size", "4", "--micro-batch-size", "1",
            "--epas-target-layers", "3", "--epas-interval", "2", "--overlap-grad-reduce",
            "--weight-decay", "0.5", "--no-save-final", "--output-dir", str(tmp_path / "run")]
    run_script(Path(__file__).parent / "scripts" / "frozen_audit.py", args, nproc=2)
    reports = [json.loads((tmp_path / "run" / f"audit_rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["overlap_grad_reduce"]
        assert r["frozen"] == [f"decoder.layers.{i}.self_attention.linear_qk.weight" for i in (1, 2, 3)]
        assert r["in_optimizer"] == [] and r["in_ddp_buckets"] == [] and r["with_grad"] == []
        assert r["moved_after_switch"] == []
        assert r["trainable_in_buckets"]
