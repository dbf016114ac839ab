"""epas-bench train runs end to end and reports what it promises (speed itself is not asserted)."""

import json
import subprocess
import sys

import pytest

from epas_testing import REPO


def test_train_bench_reports_ratio_and_flop_limit():
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "train", "--preset", "tiny", "--region", "2",
                           "--iters", "2", "--blocks", "2", "--warmup", "1"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([l for l in proc.stdout.splitlines() if l.startswith("BENCH ")][-1][6:])
    for key in ("baseline_tokens_per_s", "epas_tokens_per_s", "ratio", "flop_limit_ratio"):
        assert record[key] > 0, key
    assert record["ratio"] == record["epas_tokens_per_s"] / record["baseline_tokens_per_s"]
    # By hand, forward FLOPs per token (2 per multiply-add) of the tiny shape: 4 layers, h 64, 4 query
    # heads / 2 KV groups of 16, ffn 176, bench vocabulary 8192, seq 64. SDPA skips the causally
    # masked half of the scores, so the s^2 terms are halved.
    qkv, v_only = 2 * 64 * (4 + 2 * 2) * 16, 2 * 64 * 2 * 16         # 16384, 4096
    attention = (2 * 64 * 64 + 2 * 64 * 64) // 2                      # scores + probs.V, halved: 8192
    layer = qkv + attention + 2 * 64 * 64 + 3 * 2 * 64 * 176         # + proj + SwiGLU = 100352
    sharing = layer - qkv + v_only                                   # 88064
    head = 2 * 64 * 8192                                             # 1048576
    assert record["flop_limit_ratio"] == pytest.approx((4 * layer + head) / (2 * layer + 2 * sharing + head), rel=1e-12)
    assert record["core_attention"] == "sdpa" and record["flop_convention"] == "megatron"


def test_bench_rejects_a_region_without_source():
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "train", "--preset", "tiny", "--region", "4"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--region" in proc.stderr
