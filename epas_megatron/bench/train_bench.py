"""``epas-bench train``: training throughput of EPAS (and Random-LTD, and both; and
Mixture-of-Channels MLPs, alone and with EPAS) against the baseline, measured in one run.

The models -- the baseline (region 0) and each ``--method``: ``epas`` (the deepest ``--region``
layers sharing from the start), ``random-ltd`` (the middle layers keep ``--kept-tokens`` of each
sequence), ``both`` (the two together; the region's source projects Q/K/V for every token), ``moc``
(Mixture-of-Channels MLPs keeping ``--moc-topk`` of the SwiGLU channels) and ``epas-moc`` (EPAS
with them) -- are built in
the same process group from the same seed (so they hold the same weights), on synthetic tokens
(no data loading in the timing). Timed blocks alternate between
them (A B, B A, ...) after warm-up steps, and each model's throughput is the median over its
blocks, because timing on shared machines drifts by several percent between blocks.

Reported: tokens/s of each (input tokens: every token still gets a loss under Random-LTD), the
measured ratio (method / baseline), the FLOP-limit ratio (baseline training FLOPs / the method's,
from the layerwise FLOPs model: the speed-up if time were purely proportional to FLOPs), and
measured / limit. Mixture-of-Channels keeps its GEMMs dense in training (as the paper trains):
its FLOPs are the dense MLP's, so its FLOP limit is 1 and the ratio is what the Top-K, gathers
and scatters cost (on a GPU, with a sparse kernel, the paper reports 0.935-0.971x). The FLOP
convention follows the backend: local attention computes the full score matrix (no causal
halving), Transformer Engine's fused kernels skip the masked half.
Last line: ``BENCH {json}``.
"""

from __future__ import annotations

import json

import torch

from epas_megatron.bench.common import BenchConfig
from epas_megatron.model.moc_sizes import MoCSettings


def run_train_bench(cfg: BenchConfig, log=print) -> dict:
    """Measure both models; returns the BENCH record (call inside an initialised process group)."""
    import torch.distributed as dist

    from epas_megatron.assembly import plan_for_preset
    from epas_megatron.bench.common import alternating_throughput, bench_variant, default_backend
    from epas_megatron.metrics.flops import Convention, layerwise_forward_flops
    from epas_megatron.model.architecture import ModelShape
    from epas_megatron.model.fusions import choose_precision
    from epas_megatron.random_ltd.option import RandomLTDSettings
    from epas_megatron.random_ltd.schedule import default_layers
    from epas_megatron.sharing.shape import region_layers

    arch = plan_for_preset(cfg.preset, seq_length=cfg.seq_length).arch
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    cuda = torch.cuda.is_available()
    backend = default_backend()
    kept = cfg.kept_tokens or cfg.seq_length // 2
    ltd = RandomLTDSettings(default_layers(arch.num_layers), seed=cfg.seed)
    variants = {"baseline": ((), ()), "epas": (sharing, ()), "random-ltd": ((), (ltd,)), "both": (sharing, (ltd,)),
                "moc": ((), ()), "epas-moc": (sharing, ())}  # name -> (sharing layers, build options)
    moc = MoCSettings(cfg.moc_topk, cfg.moc_groups)
    states = {name: bench_variant(plan_for_preset(cfg.preset, variants[name][0], seq_length=cfg.seq_length, tp=cfg.tp, pp=cfg.pp,
                                                  share=cfg.share, backend=backend, core_attention=cfg.core_attention,
                                                  options=variants[name][1],
                                                  moc=moc if "moc" in name else None),
                                  micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches, seed=cfg.seed,
                                  kept_tokens=kept)
              for name in ("baseline", *cfg.methods)}
    dp = dist.get_world_size() // (cfg.tp * cfg.pp)
    tokens_per_iter = cfg.seq_length * cfg.micro_batch_size * cfg.num_microbatches * dp
    log(f"bench: {cfg.preset} ({arch.num_layers} layers, h {arch.hidden_size}), methods {', '.join(cfg.methods)}: region {cfg.region} "
        f"{list(sharing)}"
        f"{f', Random-LTD layers {ltd.layers[0]}-{ltd.layers[-1]} keep {kept} of {cfg.seq_length} tokens'
           if set(cfg.methods) & {'random-ltd', 'both'} else ''}"
        f"{f', Mixture-of-Channels: top {cfg.moc_topk:g} of the channels in {cfg.moc_groups} groups (dense GEMMs)'
           if set(cfg.methods) & {'moc', 'epas-moc'} else ''}, "
        f"seq {cfg.seq_length}, {cfg.num_microbatches} x {cfg.micro_batch_size} x DP {dp}, TP {cfg.tp}, PP {cfg.pp}, "
        f"{backend} layers{'' if backend != 'local' else f' ({cfg.core_attention} attention)'}, {'bf16 CUDA' if cuda else 'fp32 CPU'}; "
        f"{cfg.warmup} warm-up + {cfg.iters} timed iterations each")
    tps = alternating_throughput(states, tokens_per_iter, iters=cfg.iters, blocks=cfg.blocks, warmup=cfg.warmup, log=log)
    # Fused kernels (TE, SDPA) skip the causally masked half of the scores; unfused attention does not.
    convention = Convention.PAPER if (backend == "local" and cfg.core_attention == "unfused") else Convention.MEGATRON
    shape = ModelShape(arch, cfg.seq_length)

    def forward_flops(name):
        region, options = variants[name]
        dropping = {layer for option in options if isinstance(option, RandomLTDSettings) for layer in option.layers}
        modes = [f"share_{cfg.share}" if i in region else "compute" for i in range(arch.num_layers)]
        source = region[0] - 1 if region else None
        tokens = [kept if i in dropping else cfg.seq_length for i in range(arch.num_layers)]
        qkv_tokens = [cfg.seq_length if i == source else n for i, n in enumerate(tokens)]
        return layerwise_forward_flops(shape, modes, tokens, convention, qkv_tokens)

    methods = {}
    for name in cfg.methods:
        ratio, limit = tps[name] / tps["baseline"], forward_flops("baseline") / forward_flops(name)
        methods[name] = {"tokens_per_s": tps[name], "ratio": ratio, "flop_limit_ratio": limit, "measured_over_limit": ratio / limit}
    record = {
        "preset": cfg.preset, "region": cfg.region, "seq_length": cfg.seq_length, "tp": cfg.tp, "pp": cfg.pp,
        "baseline_tokens_per_s": tps["baseline"], "methods": methods, "random_ltd_kept_tokens": kept,
        "flop_convention": convention.name.lower(),
        "backend": backend, "core_attention": cfg.core_attention if backend == "local" else "te",
        "device": _device_name(), "precision": choose_precision("auto", cuda),
        "blocks": cfg.blocks, "iters_per_block": max(1, cfg.iters // cfg.blocks),
        "moc_topk": cfg.moc_topk, "moc_groups": cfg.moc_groups,
    }
    if "epas" in methods:  # the EPAS figures under their established keys
        record.update(epas_tokens_per_s=tps["epas"], ratio=methods["epas"]["ratio"], flop_limit_ratio=methods["epas"]["flop_limit_ratio"],
                      measured_over_limit=methods["epas"]["measured_over_limit"])
    log(f"baseline {tps['baseline']:.1f} tok/s | " + " | ".join(
        f"{name} {m['tokens_per_s']:.1f} tok/s, ratio {m['ratio']:.4f}, FLOP limit {m['flop_limit_ratio']:.4f}, "
        f"measured/limit {m['measured_over_limit']:.4f}" for name, m in methods.items()))
    return record


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def format_record(record: dict) -> str:
    """The machine-readable last line."""
    return "BENCH " + json.dumps(record)
