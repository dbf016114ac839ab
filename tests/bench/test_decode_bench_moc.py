"""epas-bench decode with --moc-topk: the Mixture-of-Channels variants (dense-masked and sparse-read
W_down) run beside the baseline, their ratios are those of the printed block rates, and the W_down
bytes per step and per token are the ones counted by hand (speed itself is not asserted)."""

import json
import re
import subprocess
import sys

import pytest

from epas_megatron.bench.decode_bench import DecodeBenchConfig, check_config
from epas_megatron.config.presets import get_preset
from epas_megatron.errors import ConfigError
from epas_megatron.inference.decode_cost import decode_bytes_per_step
from epas_megatron.model.architecture import architecture_from_preset
from epas_testing import REPO

CMD = [sys.executable, "-m", "epas_megatron.bench.cli", "decode", "--preset", "tiny", "--region", "2", "--batch", "2",
       "--context", "24", "--new-tokens", "3", "--blocks", "2", "--warmup", "1", "--moc-topk", "0.25", "--moc-groups", "4"]
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}


@pytest.mark.cpu_only  # fp32 eager steps: the CPU defaults
def test_moc_variants_report_ratios_and_w_down_bytes():
    proc = subprocess.run(CMD, cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads([line for line in proc.stdout.splitlines() if line.startswith("BENCH ")][-1][6:])
    blocks = [dict((name, float(rate)) for name, rate in re.findall(r"(\S+) ([\d.]+) tok/s", line))
              for line in proc.stdout.splitlines() if line.strip().startswith("block ")][:2]
    # the median of two block times is their mean: a variant's tokens/s is the harmonic mean of its block rates
    rate = {name: 2 / sum(1 / block[name] for block in blocks) for name in ("baseline", "moc-masked", "moc-sparse")}
    assert record["moc_masked_tokens_per_s"] == pytest.approx(rate["moc-masked"], rel=2e-3)
    assert record["ratio_moc_masked"] == pytest.approx(rate["moc-masked"] / rate["baseline"], rel=5e-3)
    assert record["ratio_moc_sparse"] == pytest.approx(rate["moc-sparse"] / rate["baseline"], rel=5e-3)
    assert record["ratio_moc_sparse_over_masked"] == pytest.approx(rate["moc-sparse"] / rate["moc-masked"], rel=5e-3)
    # tiny: 4 layers, h 64, ffn 176 = 4 groups of 44, 11 kept each (K = 44), fp32, batch 2:
    # dense-masked reads every W_down once a step, 4 x 64 x 176 x 4 B; sparse 2 tokens x 44 rows x 64 x 4 B per layer
    assert (record["moc_kept"], record["moc_per_group"]) == (11, 44)
    assert record["w_down_bytes_per_step_masked"] == 4 * 64 * 176 * 4 == 180224
    assert record["w_down_bytes_per_step_sparse"] == 4 * 2 * 44 * 64 * 4 == 90112
    assert record["w_down_bytes_per_token_sparse"] == 44 * 64 * 4 * 4 and record["w_down_read_ratio"] == 0.5
    # the sparse step moves the baseline's bytes less the W_down rows it does not read
    arch = architecture_from_preset(get_preset("tiny"), 25)
    total = decode_bytes_per_step(arch, ["compute"] * 4, "qk", "qk", 2, 24, 4).total
    assert record["byte_limit_ratio_moc_sparse"] == pytest.approx(total / (total - 180224 + 90112), rel=1e-12)
    assert "| MoC, sparse read of the kept W_down rows |" in proc.stdout and "top 11 of 44 channels in each of 4 groups" in proc.stdout
    # the EPAS variants still run, their KV bytes unchanged
    assert (record["kv_bytes_per_token_baseline"], record["kv_bytes_per_token_epas"]) == (1024, 768)


def test_bad_moc_settings_are_refused_before_any_model():
    with pytest.raises(ConfigError, match="--moc-groups 7 must divide --ffn-hidden-size 176"):
        check_config(DecodeBenchConfig("tiny", 2, moc_topk=0.25, moc_groups=7), 4)
    with pytest.raises(ConfigError, match="--moc-topk must be in"):
        check_config(DecodeBenchConfig("tiny", 2, moc_topk=1.5), 4)
    check_config(DecodeBenchConfig("tiny", 2, moc_groups=7), 4)  # dense: the groups are not read
