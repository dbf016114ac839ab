"""epas-bench pipeline runs under torchrun and reports the promised numbers (speed not asserted)."""

import json
import subprocess
import sys

import pytest

from epas_testing import REPO

pytestmark = pytest.mark.distributed


def test_pipeline_bench_reports_all_variants():
    from epas_megatron.config.presets import get_preset
    from epas_megatron.model.builder import LlamaArchitecture
    from epas_megatron.parallel.planner import predict_pipeline_speedup
    from epas_megatron.parallel.stage_plan import flops_layer_costs

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "epas_megatron.bench.cli", "pipeline", "--preset", "tiny", "--region", "2", "--iters", "2",
                           "--blocks", "2", "--warmup", "1"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([l for l in proc.stdout.splitlines() if l.startswith("BENCH ")][-1][6:])
    for key in ("baseline_tokens_per_s", "epas_norebalance_tokens_per_s", "epas_rebalanced_tokens_per_s",
                "pp1_baseline_tokens_per_s", "pp1_epas_tokens_per_s"):
        assert record[key] > 0, key
    assert set(record["stage_compute_s"]["baseline"]) == {"0", "1"}
    p7 = get_preset("7b")
    arch = LlamaArchitecture(p7.num_layers, p7.hidden_size, p7.num_attention_heads, p7.num_query_groups,
                             p7.ffn_hidden_size, p7.vocab_size, p7.seq_length)
    for row in record["predicted_7b"]:
        expected = predict_pipeline_speedup(flops_layer_costs(arch, 2048), 32, row["pp"], 1, 16)
        assert row["gain_rebalanced"] == pytest.approx(expected.speedup_with_rebalancing)
        assert row["gain_even_split"] == pytest.approx(expected.speedup_without_rebalancing)
    assert "| PP | EPAS gain, even split |" in proc.stdout
