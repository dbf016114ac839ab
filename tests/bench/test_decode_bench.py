"""epas-bench decode runs end to end and reports what it promises (speed itself is not asserted)."""

import json
import re
import subprocess
import sys

import pytest

from epas_testing import REPO

CMD = [sys.executable, "-m", "epas_megatron.bench.cli", "decode", "--preset", "tiny", "--region", "2", "--batch", "2",
       "--context", "24", "--new-tokens", "3", "--blocks", "2", "--warmup", "1"]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


@pytest.mark.cpu_only  # fp32 eager steps: the CPU defaults
def test_decode_bench_reports_ratios_cache_bytes_and_serving_batches():
    proc = subprocess.run([*CMD, "--kv-budget-mb", "0.25"], cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([l for l in proc.stdout.splitlines() if l.startswith("BENCH ")][-1][6:])
    # Throughput from the raw observations the bench printed: its first two block lines (--blocks 2)
    # give each variant's tokens/s per block; the median of two block times is their mean, so a
    # variant's tokens/s is the harmonic mean of its block rates (not their mean).
    blocks = [dict((name, float(rate)) for name, rate in re.findall(r"(\S+) ([\d.]+) tok/s", line))
              for line in proc.stdout.splitlines() if line.strip().startswith("block ")][:2]
    rate = {name: 2 / sum(1 / block[name] for block in blocks) for name in ("baseline", "qk", "reuse")}
    assert record["baseline_tokens_per_s"] == pytest.approx(rate["baseline"], rel=2e-3)
    assert record["ratio_qk"] == pytest.approx(rate["qk"] / rate["baseline"], rel=5e-3)
    assert record["ratio_reuse"] == pytest.approx(rate["reuse"] / rate["baseline"], rel=5e-3)
    # tiny: 4 layers, 2 KV groups of 16, fp32 -- per token 2 groups x 16 x 4 B = 128 B per cached tensor;
    # baseline 4 layers x K+V = 1024 B; region 2 with qk sharing: 2 x 2 + 2 x 1 tensors = 768 B.
    assert (record["kv_bytes_per_token_baseline"], record["kv_bytes_per_token_epas"]) == (1024, 768)
    # 0.25 MiB = 262144 B over contexts of 24 positions: 262144 // (1024 * 24) = 10, // (768 * 24) = 14.
    assert (record["max_batch_baseline"], record["max_batch_epas"]) == (10, 14)
    assert record["serving_tokens_per_s_baseline"] > 0 and record["serving_tokens_per_s_epas"] > 0
    assert 1.0 < record["byte_limit_ratio_qk"] < record["byte_limit_ratio"]
    assert "| EPAS, probability reuse |" in proc.stdout
    assert record["decode_step"] == "eager" and record["precision"] == "fp32"  # CPU: eager steps, fp32


@pytest.mark.usefixtures("single_process")
def test_decode_bench_runs_every_variant_on_the_fixed_shape_step():
    """``decode_step='static'`` (what CUDA graphs replay on a GPU) for every variant, the region
    kernel included, with the LM head tied to the embedding (``--tie-embeddings``: the engine
    must hand the head the embedding's weight); the cache sizes do not depend on either."""
    from epas_megatron.bench.decode_bench import DecodeBenchConfig, run_decode_bench

    lines = []
    cfg = DecodeBenchConfig("tiny", 2, batch=2, context=24, new_tokens=2, blocks=2, warmup=1, kv_budget_mb=0.25,
                            region_kernel="torch", decode_step="static", tie_embeddings=True)
    record = run_decode_bench(cfg, log=lines.append)
    assert record["tie_embeddings"] is True
    assert record["decode_step"] == "static" and "static decode step" in lines[0]
    assert record["reuse_kernel_tokens_per_s"] > 0 and record["reuse_tokens_per_s"] > 0 and record["qk_tokens_per_s"] > 0
    assert (record["kv_bytes_per_token_baseline"], record["kv_bytes_per_token_epas"]) == (1024, 768)
    assert (record["max_batch_baseline"], record["max_batch_epas"]) == (10, 14)


@pytest.mark.usefixtures("single_process")
def test_decode_bench_in_bf16_as_on_a_gpu(monkeypatch):
    """bf16, the GPU's precision (its models are wrapped in Megatron's Float16Module; the bench
    read the baseline's weights through the wrapper and failed on the first GPU): the cache holds
    2-byte elements -- tiny's per-token bytes are half of fp32's 1024 and 768."""
    import functools

    from epas_megatron import assembly
    from epas_megatron.bench.decode_bench import DecodeBenchConfig, run_decode_bench

    monkeypatch.setattr(assembly, "plan_for_preset", functools.partial(assembly.plan_for_preset, precision="bf16"))
    lines = []
    record = run_decode_bench(DecodeBenchConfig("tiny", 2, batch=2, context=24, new_tokens=2, blocks=2, warmup=1), log=lines.append)
    assert record["precision"] == "bf16" and "bf16 operands" in lines[0]
    assert (record["kv_bytes_per_token_baseline"], record["kv_bytes_per_token_epas"]) == (512, 384)
    assert record["reuse_tokens_per_s"] > 0 and record["qk_tokens_per_s"] > 0
