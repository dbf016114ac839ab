"""``epas-bench decode``: generation (decode) throughput of EPAS against the baseline, in one run.

Three variants of one model, built from the same seed (so the same weights, checked) and run by
the same engine (:mod:`epas_megatron.inference.engine`) with the same preallocated, in-place KV
cache and the same attention arithmetic (matmul attention, fp32 softmax):

* ``baseline``: region 0 -- every layer computes and caches its own K and V;
* ``qk``: the deepest ``--region`` layers share, V-only cache, ``softmax(Q Kᵀ)`` recomputed over
  the source's cached K (the paper's inference);
* ``reuse``: the same model, the source's probabilities reused (``P · V_own`` only);
* with ``--region-kernel torch|triton`` also ``reuse+kernel``: the region's cached ``P · V`` in
  one launch.

Each variant's cache is filled with random keys and values up to ``--context`` positions (a
decode step's cost does not depend on the cached values, and a real 2048-token prefill is not
what is measured). A timed block is ``--new-tokens`` decode steps, each at position
``--context`` (the cache is rewound after every step, so every step sees the same context);
blocks alternate between the variants, and tokens/s is ``batch`` over the median step time.

Reported with the measured ratios: the byte-limit ratio (bytes read per step, baseline over
EPAS; :mod:`epas_megatron.inference.decode_cost`) and measured / limit; KV-cache bytes per token
(from the allocated caches); and a fixed-memory serving figure: the largest batch whose caches
fit ``--kv-budget-mb`` (default: what the baseline needs at ``--batch``) for the baseline and for
EPAS, with tokens/s measured at those batches. Last line: ``BENCH {json}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from epas_megatron.errors import ConfigError

MAX_SERVING_BATCH = 64
"""Upper bound on the serving figure's batch (memory on a CPU machine)."""


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What ``epas-bench decode`` measures."""

    preset: str
    region: int
    batch: int = 8
    context: int = 2048
    new_tokens: int = 16
    blocks: int = 4
    warmup: int = 1
    share: str = "qk"
    kv_budget_mb: Optional[float] = None
    region_kernel: Optional[str] = None
    seed: int = 1234


@dataclass
class _Variant:
    engine: object
    cache: object
    tokens: torch.Tensor
    context: int


def _decode_block(variant: _Variant) -> None:
    """One timed unit: rewind to ``context`` and decode one step."""
    variant.cache.length = variant.context
    variant.engine.forward(variant.tokens, variant.cache)


def check_config(cfg: DecodeBenchConfig, num_layers: int) -> None:
    """Bad settings, before any model is built."""
    if not 0 < cfg.region < num_layers:
        raise ConfigError(f"--region must be between 1 and {num_layers - 1} for the {cfg.preset} preset")
    for name in ("batch", "context", "new_tokens", "blocks"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.kv_budget_mb is not None and cfg.kv_budget_mb <= 0:
        raise ConfigError("--kv-budget-mb must be > 0")


def _variant(model, attention, kernel, batch, cfg, vocab, generator):
    from epas_megatron.inference.engine import DecodeEngine

    engine = DecodeEngine(model, attention, kernel)
    cache = engine.new_cache(batch, cfg.context + 1)
    for buffer in (cache.computing_keys, cache.computing_values, cache.sharing_values):
        buffer.copy_(torch.randn(buffer.shape, generator=generator).to(buffer.dtype))
    tokens = torch.randint(0, vocab, (batch, 1), generator=generator).to(engine.device)
    return _Variant(engine, cache, tokens, cfg.context)


def run_decode_bench(cfg: DecodeBenchConfig, log=print) -> dict:
    """Measure the variants (call inside an initialised world of one process)."""
    from epas_megatron.bench.common import alternating_throughput
    from epas_megatron.config.presets import get_preset
    from epas_megatron.inference.decode_cost import decode_bytes_per_step, max_batch_for_budget
    from epas_megatron.inference.kv_cache import kv_bytes_per_token
    from epas_megatron.model.attention import split_qkv_rows
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import LlamaArchitecture, build_model, padded_vocab_size
    from epas_megatron.sharing.schedule import layer_modes, region_layers

    preset = get_preset(cfg.preset)
    check_config(cfg, preset.num_layers)
    vocab = padded_vocab_size(preset.vocab_size or 8192)
    arch = LlamaArchitecture(preset.num_layers, preset.hidden_size, preset.num_attention_heads, preset.num_query_groups,
                             preset.ffn_hidden_size, vocab, max(cfg.context + 1, preset.seq_length))
    cuda = torch.cuda.is_available()
    precision = "bf16" if cuda else "fp32"
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    models = {}
    for name, layers in (("baseline", ()), ("epas", sharing)):
        plan = BuildPlan.for_region(arch, layers, seq_length=cfg.context, share=cfg.share, precision=precision)
        models[name] = build_model(plan, seed=cfg.seed).chunks[0].eval()
    # Same weights: the first sharing layer's own projection is the baseline layer's rows of it.
    first = sharing[0]
    hn = arch.hidden_size // arch.num_attention_heads
    fused = models["baseline"].decoder.layers[first].self_attention.linear_qkv.weight
    part = "v" if cfg.share == "qk" else "q"
    rows = split_qkv_rows(fused, ("q", "k", "v"), arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups, hn)[part]
    if not torch.equal(rows, models["epas"].decoder.layers[first].self_attention.own_projection.weight):
        raise RuntimeError("the baseline and EPAS models were built with different weights")

    generator = torch.Generator().manual_seed(cfg.seed)
    attentions = [("baseline", models["baseline"], "qk", None), ("qk", models["epas"], "qk", None)]
    if cfg.share == "qk":
        attentions.append(("reuse", models["epas"], "reuse", None))
        if cfg.region_kernel is not None:
            attentions.append(("reuse+kernel", models["epas"], "reuse", cfg.region_kernel))
    else:
        log("note: --share kv has no probability reuse (a KV-sharing layer has its own Q); reuse is not measured")
    variants = {name: _variant(model, attention, kernel, cfg.batch, cfg, vocab, generator)
                for name, model, attention, kernel in attentions}
    element = 2 if cuda else 4
    log(f"decode bench: {cfg.preset} ({arch.num_layers} layers, h {arch.hidden_size}, {arch.num_attention_heads}/"
        f"{arch.num_query_groups} heads), region {cfg.region} {list(sharing)} ({cfg.share}), batch {cfg.batch}, context "
        f"{cfg.context}, {cfg.new_tokens} decode steps per block, {cfg.blocks} blocks; preallocated in-place KV cache, "
        f"matmul attention with fp32 softmax, {precision} on {'CUDA' if cuda else 'CPU'}")
    tps = alternating_throughput(variants, cfg.batch, iters=cfg.new_tokens * cfg.blocks, blocks=cfg.blocks,
                                 warmup=cfg.warmup, log=log, step=_decode_block)

    modes = {"baseline": layer_modes(arch.num_layers, ()), "epas": layer_modes(arch.num_layers, sharing)}
    step_bytes = {name: decode_bytes_per_step(arch, modes["baseline" if name == "baseline" else "epas"], cfg.share,
                                              "reuse" if name.startswith("reuse") else "qk", cfg.batch, cfg.context, element)
                  for name in variants}
    per_token = {name: kv_bytes_per_token(modes[name], cfg.share, arch.num_query_groups, hn, element) for name in modes}
    for name, variant in variants.items():
        allocated = variant.cache.nbytes // (cfg.batch * variant.cache.max_length)
        expected = per_token["baseline" if name == "baseline" else "epas"]
        if allocated != expected:
            raise RuntimeError(f"{name}: the cache holds {allocated} bytes per token, the formula says {expected}")
    del variants

    budget = int(cfg.kv_budget_mb * 2**20) if cfg.kv_budget_mb else per_token["baseline"] * cfg.batch * cfg.context
    max_batch = {name: min(MAX_SERVING_BATCH, max_batch_for_budget(budget, per_token[name], cfg.context)) for name in modes}
    serving = {}
    if min(max_batch.values()) >= 1:
        serving_variants = {
            "baseline": _variant(models["baseline"], "qk", None, max_batch["baseline"], cfg, vocab, generator),
            "epas": _variant(models["epas"], "reuse" if cfg.share == "qk" else "qk", None, max_batch["epas"], cfg, vocab, generator),
        }
        log(f"fixed KV budget {budget / 2**20:.0f} MiB: baseline batch {max_batch['baseline']}, EPAS batch {max_batch['epas']}")
        steps_per_s = alternating_throughput(serving_variants, 1, iters=cfg.new_tokens * cfg.blocks, blocks=cfg.blocks,
                                             warmup=cfg.warmup, log=lambda *a: None, step=_decode_block)
        serving = {name: steps_per_s[name] * max_batch[name] for name in serving_variants}

    best = "reuse" if "reuse" in tps else "qk"
    record = {
        "preset": cfg.preset, "region": cfg.region, "share": cfg.share, "batch": cfg.batch, "context": cfg.context,
        "new_tokens": cfg.new_tokens, "blocks": cfg.blocks, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "precision": precision, "cache": "preallocated in-place", "attention": "matmul, fp32 softmax",
        "baseline_tokens_per_s": tps["baseline"], "qk_tokens_per_s": tps["qk"], "reuse_tokens_per_s": tps.get("reuse"),
        "ratio_qk": tps["qk"] / tps["baseline"], "ratio_reuse": tps["reuse"] / tps["baseline"] if "reuse" in tps else None,
        "byte_limit_ratio": step_bytes["baseline"].total / step_bytes[best].total,
        "byte_limit_ratio_qk": step_bytes["baseline"].total / step_bytes["qk"].total,
        "kv_bytes_per_token_baseline": per_token["baseline"], "kv_bytes_per_token_epas": per_token["epas"],
        "kv_budget_bytes": budget, "max_batch_baseline": max_batch["baseline"], "max_batch_epas": max_batch["epas"],
        "serving_tokens_per_s_baseline": serving.get("baseline"), "serving_tokens_per_s_epas": serving.get("epas"),
    }
    record["measured_over_limit"] = (tps[best] / tps["baseline"]) / record["byte_limit_ratio"]
    record["measured_over_limit_qk"] = record["ratio_qk"] / record["byte_limit_ratio_qk"]
    if "reuse+kernel" in tps:
        record["reuse_kernel_tokens_per_s"] = tps["reuse+kernel"]
        record["region_kernel"] = cfg.region_kernel
    log(format_table(record))
    return record


def format_table(record: dict) -> str:
    """The markdown table printed before the BENCH line."""
    base = record["baseline_tokens_per_s"]
    rows = ["| variant | tokens/s | vs baseline | byte limit | KV bytes/token |", "|---|---|---|---|---|",
            f"| baseline (region 0) | {base:.1f} | 1.000 | 1.000 | {record['kv_bytes_per_token_baseline']} |",
            f"| EPAS, Q/K path | {record['qk_tokens_per_s']:.1f} | {record['ratio_qk']:.3f} | "
            f"{record['byte_limit_ratio_qk']:.3f} | {record['kv_bytes_per_token_epas']} |"]
    if record["reuse_tokens_per_s"] is not None:
        rows.append(f"| EPAS, probability reuse | {record['reuse_tokens_per_s']:.1f} | {record['ratio_reuse']:.3f} | "
                    f"{record['byte_limit_ratio']:.3f} | {record['kv_bytes_per_token_epas']} |")
    if "reuse_kernel_tokens_per_s" in record:
        rows.append(f"| EPAS, reuse + {record['region_kernel']} region kernel | {record['reuse_kernel_tokens_per_s']:.1f} | "
                    f"{record['reuse_kernel_tokens_per_s'] / base:.3f} | | |")
    if record["serving_tokens_per_s_baseline"] is not None:
        rows.append(f"\nfixed KV budget {record['kv_budget_bytes'] / 2**20:.0f} MiB: baseline batch "
                    f"{record['max_batch_baseline']} at {record['serving_tokens_per_s_baseline']:.1f} tokens/s, EPAS batch "
                    f"{record['max_batch_epas']} at {record['serving_tokens_per_s_epas']:.1f} tokens/s "
                    f"({record['serving_tokens_per_s_epas'] / record['serving_tokens_per_s_baseline']:.3f}x)")
    return "\n".join(rows)
