"""``epas-bench hf-decode`` runs end to end on a tiny shape and reports what it promises: the
ratio of the tokens/s it printed per block, and peak cache bytes read from the caches equal to
the hand-computed sizes (speed itself is not asserted)."""

import json
import re

import pytest

from epas_megatron.bench.cli import main


def test_hf_decode_bench_on_a_tiny_shape(capsys):
    code = main(["hf-decode", "--preset", "tiny", "--batch", "2", "--context", "20", "--new-tokens", "3", "--blocks", "2"])
    out = capsys.readouterr().out
    assert code == 0
    record = json.loads([line for line in out.splitlines() if line.startswith("BENCH ")][-1][len("BENCH "):])
    assert record["region"] == 2 and record["share"] == "qk"
    # tokens/s from the block lines: the median of two block times is their mean -> the harmonic mean of the rates.
    blocks = [dict((name, float(rate)) for name, rate in re.findall(r"(\w+) ([\d.]+) tok/s", line))
              for line in out.splitlines() if line.strip().startswith("block ")]
    assert len(blocks) == 2
    rate = {name: 2 / sum(1 / block[name] for block in blocks) for name in ("region0", "epas")}
    assert record["region0_tokens_per_s"] == pytest.approx(rate["region0"], rel=2e-3)
    assert record["ratio"] == pytest.approx(rate["epas"] / rate["region0"], rel=5e-3)
    # tiny: 4 layers, 2 KV groups of 16, fp32: 128 B per cached K or V of a token; region 0 caches
    # 4 x (K + V) = 1024 B, region 2 ('qk') 2 x (K + V) + 2 x V = 768 B; the peak holds
    # batch 2 x (20 - 1 prompt + 3 generated) positions.
    positions = 2 * (20 - 1 + 3)
    assert (record["peak_cache_bytes_region0"], record["peak_cache_bytes_epas"]) == (1024 * positions, 768 * positions)
    assert (record["formula_bytes_per_token_region0"], record["formula_bytes_per_token_epas"]) == (1024, 768)
    assert "| region 2 |" in out


def test_hf_decode_bench_refuses_a_bad_region(capsys):
    assert main(["hf-decode", "--preset", "tiny", "--region", "4"]) == 2
    assert capsys.readouterr().err.strip() == "error: --region must be between 1 and 3 for the tiny preset, got 4"
