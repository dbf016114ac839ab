"""``epas-bench train`` with Transformer Engine layers against local layers, at the 125m and 1b
presets, half the layers sharing (the paper's ratio) -- skipped where TE does not import; issue #42
item 3. Written 2026-11-28, **not yet run on a GPU**.

``epas-bench`` has no ``--transformer-impl``: it takes TE wherever TE loads
(``bench.common.default_backend``). So the benchmark runs here in this process (the ``world``
fixture's one-GPU NCCL world, as ``epas-bench`` makes its own), once with TE layers and once with
local layers (``default_backend`` patched), same preset, seed, synthetic tokens and timing. Each
record is checked for sanity, never for a speed (timing on a shared node drifts): bf16 on this
GPU, both models timed, EPAS / baseline within 0.7-1.5, the FLOP limit within 1.0-1.2. Control:
each record names the layers it was asked for (the comparison is TE against local, not one
backend twice), and both carry the same FLOP limit (TE and SDPA both skip the masked half:
Megatron's convention) -- so a difference between their ratios is the kernels', not the model's.
The ratios and tokens/s are printed for the ledger.
"""

import gc

import pytest
import torch

from epas_megatron.model.fusions import transformer_engine_importable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_importable(),
                       reason="Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)"),
]


@pytest.mark.parametrize("preset, micro_batch_size, iters", [("125m", 8, 8), ("1b", 2, 4)], ids=["125m", "1b"])
def test_train_bench_te_against_local_layers(world, monkeypatch, preset, micro_batch_size, iters):
    """seq 2048, half the layers sharing (6 of 12; 11 of 22), 1 warm-up and ``iters`` timed
    iterations in 2 alternating blocks per model. About 15 s at 125m; about 50 s at 1b, most of it
    drawing the weights on the CPU (7 s per billion parameters, four models: baseline and EPAS per
    backend) -- deselect with ``-k 'not 1b'`` when time is short."""
    from epas_megatron.bench import common
    from epas_megatron.bench.common import BenchConfig
    from epas_megatron.bench.train_bench import run_train_bench
    from epas_megatron.config.presets import get_preset

    layers = get_preset(preset).num_layers
    cfg = BenchConfig(preset=preset, region=layers // 2, iters=iters, blocks=2, warmup=1, seq_length=2048,
                      micro_batch_size=micro_batch_size, num_microbatches=1)
    records = {}
    for backend in ("transformer_engine", "local"):
        monkeypatch.setattr(common, "default_backend", lambda backend=backend: backend)
        records[backend] = run_train_bench(cfg, log=print)
        gc.collect()
        torch.cuda.empty_cache()
    for backend, record in records.items():
        assert record["backend"] == backend, record  # the control: what was asked for ran
        assert record["device"] == torch.cuda.get_device_name() and record["precision"] == "bf16", record
        assert record["region"] == layers // 2 and record["flop_convention"] == "megatron", record
        assert record["baseline_tokens_per_s"] > 0 and record["epas_tokens_per_s"] > 0, record
        assert 0.7 < record["ratio"] < 1.5, record
        assert 1.0 < record["flop_limit_ratio"] < 1.2, record
    te, local = records["transformer_engine"], records["local"]
    assert te["flop_limit_ratio"] == local["flop_limit_ratio"], (te, local)
    print(f"bench train {preset} seq 2048, region {layers // 2} of {layers}: TE EPAS/baseline {te['ratio']:.4f} "
          f"(FLOP limit {te['flop_limit_ratio']:.4f}), baseline {te['baseline_tokens_per_s']:,.0f} tok/s; local "
          f"{local['ratio']:.4f}, baseline {local['baseline_tokens_per_s']:,.0f} tok/s; TE / local baseline "
          f"{te['baseline_tokens_per_s'] / local['baseline_tokens_per_s']:.3f}")
