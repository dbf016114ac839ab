"""The benchmarks on a GPU produce sane records: synchronised timing, bf16, the device named,
ratios near the FLOP limit (never asserted as a speed, only as a sanity range)."""

import subprocess
import sys

import pytest
import torch

from epas_testing import REPO, child_environ, json_lines

pytestmark = pytest.mark.gpu


def _bench(args, nproc=1):
    launcher = [sys.executable, "-m", "epas_megatron.bench.cli"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "epas_megatron.bench.cli"]
    proc = subprocess.run([*launcher, *args], cwd=REPO, capture_output=True, text=True, timeout=900, env=child_environ())
    assert proc.returncode == 0, proc.stderr[-4000:]
    (record,) = json_lines(proc.stdout, "BENCH")
    return record


def test_train_bench_record():
    record = _bench(["train", "--preset", "small", "--region", "4", "--iters", "8", "--blocks", "2", "--warmup", "2"])
    assert record["device"] == torch.cuda.get_device_name() and record["precision"] == "bf16"
    assert record["baseline_tokens_per_s"] > 0 and record["epas_tokens_per_s"] > 0
    assert 0.7 < record["ratio"] < 1.5, record
    assert 1.0 < record["flop_limit_ratio"] < 1.2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the pipeline benchmark needs 2 GPUs (PP=2)")
def test_pipeline_bench_record():
    record = _bench(["pipeline", "--preset", "small", "--region", "4", "--iters", "8", "--blocks", "2", "--warmup", "2"], nproc=2)
    assert record["baseline_tokens_per_s"] > 0 and record["epas_rebalanced_tokens_per_s"] > 0
    assert set(record["stage_compute_s"]["baseline"]) == {"0", "1"}  # JSON keys
