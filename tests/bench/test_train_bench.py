"""epas-bench train runs end to end and reports what it promises (speed itself is not asserted)."""

import json
import subprocess
import sys

from epas_testing import REPO
from epas_megatron.metrics.flops import Convention, ModelShape, flop_limit_ratio


def test_train_bench_reports_ratio_and_flop_limit():
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "train", "--preset", "tiny", "--region", "2",
                           "--iters", "2", "--blocks", "2", "--warmup", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([l for l in proc.stdout.splitlines() if l.startswith("BENCH ")][-1][6:])
    for key in ("baseline_tokens_per_s", "epas_tokens_per_s", "ratio", "flop_limit_ratio"):
        assert record[key] > 0, key
    assert record["ratio"] == record["epas_tokens_per_s"] / record["baseline_tokens_per_s"]
    # tiny: 4 layers, h 64, 4/2 heads, ffn 176, vocab padded to 128 (default tokenizer 512 -> bench uses 8192).
    shape = ModelShape(4, 64, 4, 2, 176, 8192, 64)
    assert record["flop_limit_ratio"] == flop_limit_ratio(shape, 2, convention=Convention.PAPER)


def test_bench_rejects_a_region_without_source():
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "train", "--preset", "tiny", "--region", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--region" in proc.stderr
