"""``epas-bench hf-decode``: transformers ``generate()`` on the EPAS export, region 0 against half
the layers sharing, in one run.

    epas-bench hf-decode --preset 125m --batch 8 --context 2048      # the default: CPU, fp32

What is measured: one ``EpasLlamaForCausalLM`` (:mod:`epas_megatron.hf`, the class
``epas-convert hf-export --region`` writes), built in-process with random weights from
``--preset``'s shape and ``--region`` exported sharing layers (default: half the layers). The
two variants are the same model and weights at ``epas_region`` 0 (plain LLaMA: every layer
caches K and V) and at ``--region`` (the sharing layers cache V only for ``--share qk``, nothing
for ``kv``), each with its own :class:`~epas_megatron.hf.cache_epas.EpasCache`.

Each variant's cache is prefilled once with ``--context`` random prompt tokens (untimed). A
timed block is one ``generate(max_new_tokens=min_new_tokens=--new-tokens, greedy)`` over the
full prompt with that cache -- transformers' own decode loop: the last prompt token, then
``--new-tokens - 1`` steps, each growing the cache by one position -- after which the cache is
cropped back to the prompt. Blocks alternate between the variants (``--blocks`` each, after one
untimed block); tokens/s is ``batch * new_tokens`` over the median block time.

Reported: tokens/s per variant and their ratio (EPAS over region 0), the peak cache bytes
(read from the cache's tensors at the end of a block, the longest it gets) and per token, with
the formula (:func:`~epas_megatron.hf.cache_epas.cache_bytes_per_token`). Last line:
``BENCH {json}``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from epas_megatron.errors import ConfigError


@dataclass(frozen=True)
class HfDecodeBenchConfig:
    """What ``epas-bench hf-decode`` measures."""

    preset: str = "125m"
    """Model shape (layers, widths, heads, vocabulary)."""

    region: Optional[int] = None
    """Sharing layers of the EPAS variant (None: half the layers)."""

    batch: int = 8
    """Sequences generated together."""

    context: int = 2048
    """Prompt tokens in the cache before the timed generation."""

    new_tokens: int = 16
    """Tokens each timed ``generate()`` produces."""

    blocks: int = 3
    """Timed blocks per variant (alternating)."""

    share: str = "qk"
    """'qk' or 'kv'."""

    reuse_probs: bool = False
    """The EPAS variant reuses the source's attention probabilities ('qk')."""

    seed: int = 1234
    """Initialisation and prompt seed."""


def check_config(cfg: HfDecodeBenchConfig, num_layers: int) -> int:
    """The region the bench runs (``ConfigError`` naming the flag for a bad setting)."""
    region = num_layers // 2 if cfg.region is None else cfg.region
    if not 0 < region < num_layers:
        raise ConfigError(f"--region must be between 1 and {num_layers - 1} for the {cfg.preset} preset, got {region}")
    for flag, value in (("--batch", cfg.batch), ("--context", cfg.context), ("--new-tokens", cfg.new_tokens),
                        ("--blocks", cfg.blocks)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if cfg.reuse_probs and cfg.share != "qk":
        raise ConfigError("--reuse-probs needs --share qk")
    return region


def build_model(cfg: HfDecodeBenchConfig, region: int):
    """The EPAS model of ``cfg``'s preset with ``region`` exported sharing layers, random weights:
    the preset's architecture as every benchmark builds it (:func:`~epas_megatron.assembly.plan_for_preset`),
    in the export's config (:func:`~epas_megatron.convert.hf_llama.hf_config_kwargs`)."""
    from epas_megatron.assembly import plan_for_preset
    from epas_megatron.convert.hf_llama import hf_config_kwargs
    from epas_megatron.hf import EpasLlamaConfig, EpasLlamaForCausalLM

    arch = plan_for_preset(cfg.preset, seq_length=cfg.context + cfg.new_tokens, precision="fp32").arch
    layers = arch.num_layers
    config = EpasLlamaConfig(
        **hf_config_kwargs(arch),
        epas_share=cfg.share, epas_sharing_layers=list(range(layers - region, layers)), epas_reuse_probs=cfg.reuse_probs,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(cfg.seed)
    return EpasLlamaForCausalLM(config).eval()


def run_hf_decode_bench(cfg: HfDecodeBenchConfig, log: Callable[[str], None] = print) -> dict:
    """Measure both variants (see the module notes); returns the ``BENCH`` record."""
    from epas_megatron.config.presets import get_preset
    from epas_megatron.hf import EpasCache, cache_bytes_per_token

    region = check_config(cfg, get_preset(cfg.preset).num_layers)
    model = build_model(cfg, region)
    prompt = torch.randint(0, model.config.vocab_size, (cfg.batch, cfg.context), generator=torch.Generator().manual_seed(cfg.seed))
    variants = {"region0": 0, "epas": region}
    caches, peak, formula, times = {}, {}, {}, {name: [] for name in variants}
    with torch.inference_mode():
        for name, size in variants.items():
            model.set_epas_region(size)
            caches[name] = EpasCache(model.config)
            model(prompt[:, :-1], cache=caches[name], use_cache=True)  # untimed prefill of all but the last token
            formula[name] = cache_bytes_per_token(model.config, model.dtype)
        for block in range(cfg.blocks + 1):  # block 0: untimed warm-up
            line = []
            for name, size in variants.items():
                model.set_epas_region(size)
                start = time.perf_counter()
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=caches[name], do_sample=False,
                                     max_new_tokens=cfg.new_tokens, min_new_tokens=cfg.new_tokens, pad_token_id=0)
                elapsed = time.perf_counter() - start
                assert out.shape[1] == cfg.context + cfg.new_tokens
                peak[name] = max(peak.get(name, 0), caches[name].cached_bytes())
                caches[name].crop(-cfg.new_tokens)
                if block:
                    times[name].append(elapsed)
                    line.append(f"{name} {cfg.batch * cfg.new_tokens / elapsed:.2f} tok/s")
            if block:
                log(f"  block {block}: " + ", ".join(line))
    rate = {name: cfg.batch * cfg.new_tokens / statistics.median(times[name]) for name in variants}
    positions = cfg.context - 1 + cfg.new_tokens  # the most the cache holds: prompt + generated, less the last token
    record = {
        "bench": "hf-decode", "preset": cfg.preset, "region": region, "share": cfg.share, "reuse_probs": cfg.reuse_probs,
        "batch": cfg.batch, "context": cfg.context, "new_tokens": cfg.new_tokens, "blocks": cfg.blocks,
        "device": "cpu", "precision": "fp32", "threads": torch.get_num_threads(),
        "region0_tokens_per_s": rate["region0"], "epas_tokens_per_s": rate["epas"], "ratio": rate["epas"] / rate["region0"],
        "peak_cache_bytes_region0": peak["region0"], "peak_cache_bytes_epas": peak["epas"],
        "cache_bytes_ratio": peak["epas"] / peak["region0"],
        "cache_bytes_per_token_region0": peak["region0"] // (cfg.batch * positions),
        "cache_bytes_per_token_epas": peak["epas"] // (cfg.batch * positions),
        "formula_bytes_per_token_region0": formula["region0"], "formula_bytes_per_token_epas": formula["epas"],
    }
    log(f"hf-decode {cfg.preset}: region 0 vs {region} sharing layers ({cfg.share}), batch {cfg.batch}, "
        f"context {cfg.context}, {cfg.new_tokens} new tokens, CPU fp32, {torch.get_num_threads()} threads")
    log(f"| variant | tokens/s | peak cache MiB | cache bytes/token |\n|---|---|---|---|\n"
        f"| region 0 | {rate['region0']:.2f} | {peak['region0'] / 2**20:.1f} | {record['cache_bytes_per_token_region0']} |\n"
        f"| region {region} | {rate['epas']:.2f} | {peak['epas'] / 2**20:.1f} | {record['cache_bytes_per_token_epas']} |")
    log(f"ratio (EPAS / region 0): {record['ratio']:.3f}x tokens/s, {record['cache_bytes_ratio']:.3f}x cache bytes")
    return record
