"""epas-bench train runs end to end and reports what it promises (speed itself is not asserted)."""

import json
import re
import subprocess
import sys
import time

import pytest

from epas_testing import REPO


def _block_rates(stdout: str) -> dict[str, list[float]]:
    """The per-block tokens/s the bench logs: ``  block 2/3: epas 1234.5 tok/s, baseline 1200.0 tok/s``."""
    rates = {"baseline": [], "epas": [], "random-ltd": [], "both": [], "moc": [], "epas-moc": []}
    for line in stdout.splitlines():
        if re.match(r"\s+block \d+/\d+:", line):
            for name, value in re.findall(r"(baseline|epas-moc|epas|random-ltd|both|moc) ([0-9.]+) tok/s", line):
                rates[name].append(float(value))
    return rates


def test_train_bench_reports_ratio_and_flop_limit():
    # 128 tokens per iteration (seq 64 x micro-batch 2 x 1 micro-batch, one process); three blocks of
    # one timed iteration each, so "the median over the blocks" is the middle block, no averaging.
    tokens_per_iteration, blocks = 64 * 2 * 1, 3
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "epas_megatron.bench.cli", "train", "--preset", "tiny", "--region", "2",
                           "--iters", "3", "--blocks", "3", "--warmup", "1", "--seq-length", "64",
                           "--micro-batch-size", "2", "--num-microbatches", "1", "--method", "all"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    wall_s = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([l for l in proc.stdout.splitlines() if l.startswith("BENCH ")][-1][6:])
    assert (record["blocks"], record["iters_per_block"], record["seq_length"]) == (3, 1, 64)

    # Throughput against the per-block rates it is the median of (logged to 0.1 tok/s), and the
    # ratio against those medians: EPAS over baseline, not the other way round.
    rates = _block_rates(proc.stdout)
    assert all(len(values) == blocks for values in rates.values()), rates
    medians = {name: sorted(values)[1] for name, values in rates.items()}
    assert record["baseline_tokens_per_s"] == pytest.approx(medians["baseline"], abs=0.051)
    assert record["epas_tokens_per_s"] == pytest.approx(medians["epas"], abs=0.051)
    assert record["ratio"] == pytest.approx(medians["epas"] / medians["baseline"], rel=1e-3)
    for name in ("random-ltd", "both", "moc", "epas-moc"):
        got = record["methods"][name]
        assert got["tokens_per_s"] == pytest.approx(medians[name], abs=0.051)
        assert got["ratio"] == pytest.approx(medians[name] / medians["baseline"], rel=1e-3)
    # Units, against a clock outside the process: the timed iterations the rates imply (128 tokens
    # each) fit in the run's wall time. A rate in samples/s or per millisecond would not.
    timed_s = sum(tokens_per_iteration / r for values in rates.values() for r in values)
    assert 0 < timed_s < wall_s

    # By hand, forward FLOPs per token (2 per multiply-add) of the tiny shape: 4 layers, h 64, 4 query
    # heads / 2 KV groups of 16, ffn 176, bench vocabulary 8192, seq 64. SDPA skips the causally
    # masked half of the scores, so the s^2 terms are halved.
    qkv, v_only = 2 * 64 * (4 + 2 * 2) * 16, 2 * 64 * 2 * 16         # 16384, 4096
    attention = (2 * 64 * 64 + 2 * 64 * 64) // 2                      # scores + probs.V, halved: 8192
    layer = qkv + attention + 2 * 64 * 64 + 3 * 2 * 64 * 176         # + proj + SwiGLU = 100352
    sharing = layer - qkv + v_only                                   # 88064
    head = 2 * 64 * 8192                                             # 1048576
    assert record["flop_limit_ratio"] == pytest.approx((4 * layer + head) / (2 * layer + 2 * sharing + head), rel=1e-12)
    # Random-LTD: layers 1-2 keep 32 of the 64 tokens -- per input token, the linear terms halve and
    # the attention core quarters. With EPAS (region 2-3), layer 1 is the source: its Q/K/V
    # projections run on all 64 tokens, the rest on its 32.
    kept_layer = (layer - attention) // 2 + attention // 4           # 48128
    kept_sharing = (sharing - attention) // 2 + attention // 4       # 41984
    kept_source = kept_layer + qkv // 2                              # 56320
    assert record["random_ltd_kept_tokens"] == 32
    assert record["methods"]["random-ltd"]["flop_limit_ratio"] == pytest.approx((4 * layer + head) / (2 * layer + 2 * kept_layer + head),
                                                                                 rel=1e-12)
    assert record["methods"]["both"]["flop_limit_ratio"] == pytest.approx((4 * layer + head)
                                                                           / (layer + kept_source + kept_sharing + sharing + head),
                                                                           rel=1e-12)
    assert record["core_attention"] == "sdpa" and record["flop_convention"] == "megatron"
    # Mixture-of-Channels keeps its GEMMs dense in training: the dense model's FLOPs, with EPAS EPAS's.
    assert record["methods"]["moc"]["flop_limit_ratio"] == 1.0
    assert record["methods"]["epas-moc"]["flop_limit_ratio"] == pytest.approx(record["flop_limit_ratio"], rel=1e-12)
    assert (record["moc_topk"], record["moc_groups"]) == (0.2, 8)
