"""epas-bench pipeline runs under torchrun and reports the promised numbers (speed not asserted)."""

import json
import subprocess
import sys

import pytest

from epas_testing import REPO

pytestmark = pytest.mark.distributed


def test_pipeline_bench_reports_all_variants():
    from epas_megatron.config.presets import get_preset
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.parallel.stage_layouts import flops_layer_costs

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
    # The 7B predictions (16 of 32 layers sharing), checked by hand: the even split puts 32/PP
    # layers on each rank; its boundary at layer 16 starts the region, so the hand-off crosses and
    # the busiest rank is a computing middle one (two boundaries), against the baseline's last
    # rank (the LM head). The total-FLOP ratio comes from the FLOPs module directly.
    p7 = get_preset("7b")
    arch = LlamaArchitecture(p7.num_layers, p7.hidden_size, p7.num_attention_heads, p7.num_query_groups,
                             p7.ffn_hidden_size, p7.vocab_size, p7.seq_length)
    costs = flops_layer_costs(arch, 2048)
    # The FLOP-bound ideal by hand, forward FLOPs per token in units of 2·h (LLaMA-7B: h 4096,
    # MHA, SwiGLU FFN 11008, vocabulary 32000, s 2048, causal halving): a computing layer has
    # Q, K, V and output projections (4h), the MLP (3·ffn) and the two s² matmuls halved (s);
    # a sharing layer skips Q and K (2h); the LM head is V. 16 of 32 layers share.
    h, ffn, vocab, s = 4096, 11008, 32000, 2048
    compute, share = 4 * h + 3 * ffn + s, 4 * h + 3 * ffn + s - 2 * h
    ideal = (32 * compute + vocab) / (16 * compute + 16 * share + vocab)  # = 1678592 / 1547520
    rows = {row["pp"]: row for row in record["predicted_7b"]}
    assert set(rows) == {4, 8}
    for pp, row in rows.items():
        per_rank = 32 // pp * costs.compute_layer
        assert row["gain_even_split"] == pytest.approx((per_rank + costs.output_layer) / (per_rank + 2 * costs.handoff_p2p))
        assert row["gain_even_split"] <= row["gain_rebalanced"] + 1e-12
        assert row["ideal"] == pytest.approx(ideal)
    assert "| PP | EPAS gain, even split |" in proc.stdout
