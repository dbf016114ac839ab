"""``epas-bench train``: training throughput of EPAS against the baseline, measured in one run.

Both models -- the baseline (region 0) and EPAS with the deepest ``--region`` layers sharing from
the start -- are built in the same process group from the same seed (so they hold the same
weights), on synthetic tokens (no data loading in the timing). Timed blocks alternate between
them (A B, B A, ...) after warm-up steps, and each model's throughput is the median over its
blocks, because timing on shared machines drifts by several percent between blocks.

Reported: tokens/s of each, the measured ratio (EPAS / baseline), the FLOP-limit ratio
(baseline training FLOPs / EPAS training FLOPs: the speed-up if time were purely proportional to
FLOPs), and measured / limit. The FLOP convention follows the backend: local attention computes
the full score matrix (no causal halving), Transformer Engine's fused kernels skip the masked half.
Last line: ``BENCH {json}``.
"""

from __future__ import annotations

import json

import torch

from epas_megatron.bench.common import BenchConfig


def run_train_bench(cfg: BenchConfig, log=print) -> dict:
    """Measure both models; returns the BENCH record (call inside an initialised process group)."""
    import torch.distributed as dist

    from epas_megatron.config.presets import get_preset
    from epas_megatron.metrics.flops import Convention, flop_limit_ratio
    from epas_megatron.model.builder import LlamaArchitecture, padded_vocab_size
    from epas_megatron.sharing.schedule import region_layers

    from epas_megatron.bench.common import alternating_throughput, bench_variant, default_backend

    preset = get_preset(cfg.preset)
    vocab = padded_vocab_size(preset.vocab_size or 8192)
    arch = LlamaArchitecture(preset.num_layers, preset.hidden_size, preset.num_attention_heads, preset.num_query_groups,
                             preset.ffn_hidden_size, vocab, max(cfg.seq_length, preset.seq_length))
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    cuda = torch.cuda.is_available()
    backend = default_backend()
    common = dict(seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
                  seed=cfg.seed, tp=cfg.tp, pp=cfg.pp, share=cfg.share, backend=backend, core_attention=cfg.core_attention)
    states = {"baseline": bench_variant(arch, (), **common), "epas": bench_variant(arch, sharing, **common)}
    dp = dist.get_world_size() // (cfg.tp * cfg.pp)
    tokens_per_iter = cfg.seq_length * cfg.micro_batch_size * cfg.num_microbatches * dp
    log(f"bench: {cfg.preset} ({arch.num_layers} layers, h {arch.hidden_size}), region {cfg.region} {list(sharing)}, "
        f"seq {cfg.seq_length}, {cfg.num_microbatches} x {cfg.micro_batch_size} x DP {dp}, TP {cfg.tp}, PP {cfg.pp}, "
        f"{backend} layers{'' if backend != 'local' else f' ({cfg.core_attention} attention)'}, {'bf16 CUDA' if cuda else 'fp32 CPU'}; "
        f"{cfg.warmup} warm-up + {cfg.iters} timed iterations each")
    tps = alternating_throughput(states, tokens_per_iter, iters=cfg.iters, blocks=cfg.blocks, warmup=cfg.warmup, log=log)
    # Fused kernels (TE, SDPA) skip the causally masked half of the scores; unfused attention does not.
    convention = Convention.PAPER if (backend == "local" and cfg.core_attention == "unfused") else Convention.MEGATRON
    limit = flop_limit_ratio(arch.flops_shape(cfg.seq_length), cfg.region, share=cfg.share, convention=convention)
    ratio = tps["epas"] / tps["baseline"]
    record = {
        "preset": cfg.preset, "region": cfg.region, "seq_length": cfg.seq_length, "tp": cfg.tp, "pp": cfg.pp,
        "baseline_tokens_per_s": tps["baseline"], "epas_tokens_per_s": tps["epas"], "ratio": ratio,
        "flop_limit_ratio": limit, "measured_over_limit": ratio / limit, "flop_convention": convention.name.lower(),
        "backend": backend, "core_attention": cfg.core_attention if backend == "local" else "te",
        "device": _device_name(), "precision": "bf16" if cuda else "fp32",
        "blocks": cfg.blocks, "iters_per_block": max(1, cfg.iters // cfg.blocks),
    }
    log(f"baseline {tps['baseline']:.1f} tok/s | EPAS {tps['epas']:.1f} tok/s | ratio {ratio:.4f} | "
        f"FLOP limit {limit:.4f} | measured/limit {ratio / limit:.4f}")
    return record


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def format_record(record: dict) -> str:
    """The machine-readable last line."""
    return "BENCH " + json.dumps(record)
