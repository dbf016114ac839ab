"""``epas-bench decode``: generation (decode) throughput of EPAS against the baseline, in one run.

Three variants of one model, built from the same seed (so the same weights, checked) and run by
the same engine (:mod:`epas_megatron.inference.engine`) with the same preallocated, in-place KV
cache, the same attention arithmetic and the same kind of decode step:

* ``baseline``: region 0 -- every layer computes and caches its own K and V;
* ``qk``: the deepest ``--region`` layers share, V-only cache, ``softmax(Q Kᵀ)`` recomputed over
  the source's cached K (the paper's inference);
* ``reuse``: the same model, the source's probabilities reused (``P · V_own`` only);
* with ``--region-kernel torch|triton`` also ``reuse+kernel``: the region's cached ``P · V`` in
  one launch.

What one timed decode step does, per variant (like with like: every cost below is paid by every
variant that needs the work, and by none that does not):

* every variant: rewind ``cache.length`` to ``--context`` (a Python int), then one step --
  embedding of ``b`` tokens, the mask and RoPE's cos/sin once per step, per layer two norms,
  the output projection, the MLP and the residual adds, the final norm, the LM head and the fp32
  logits; no host synchronisation inside a step (the timer synchronises once per block);
* a computing layer (every layer of ``baseline``; the non-sharing layers of the others): the
  fused QKV projection, RoPE on Q and K, K and V written in place at the new slot, ``Q Kᵀ`` over
  its cached K read in the model's dtype (bf16 on CUDA: ``torch.bmm`` to fp32 scores, no fp32 copy
  of K), scale, mask and softmax in fp32 over the ``[b, g, q, T]`` scores, ``P`` cast once to the
  model's dtype, ``P · V`` over its cached V;
* a sharing layer on the Q/K path (``qk``): its V projection, V written in place, ``Q Kᵀ`` of the
  source's Q over the source's cached K, the same fp32 softmax, ``P · V_own`` -- the same cache
  bytes as a computing layer (the paper's inference saves cache memory, not reads);
* a sharing layer with reuse (``reuse``): its V projection, V written in place, ``P_src · V_own``
  -- no K read, no ``Q Kᵀ``, no softmax, no RoPE (the work EPAS removes, not a cost the baseline
  pays extra); ``reuse+kernel``: the source computes every sharing layer's cached ``P · V`` in
  one launch and each layer adds its new slot's term.

The step is either eager (:meth:`DecodeEngine.forward`, attention over slots ``[:context + 1]``)
or, with ``decode_step`` 'cuda-graph' (the default on CUDA) / 'static', the fixed-shape step
(:mod:`epas_megatron.inference.decode_step`) -- for *every* variant, each captured over its own
cache (which holds exactly ``context + 1`` slots, so the fixed shape reads what the eager step
reads); such a step also copies the ``b`` tokens into its static buffer and fills the slot
tensor (two tiny kernels, every variant). If any variant's capture fails, every variant runs the
fixed-shape step without a graph. The caches' random contents are drawn in place on the device.

Each variant's cache is filled with random keys and values up to ``--context`` positions (a
decode step's cost does not depend on the cached values, and a real 2048-token prefill is not
what is measured). A timed block is ``--new-tokens`` decode steps, each at position
``--context`` (the cache is rewound after every step, so every step sees the same context);
blocks alternate between the variants, and tokens/s is ``batch`` over the median step time.

With ``--moc-topk F --moc-groups N`` (< 1) two more variants run at region 0, a Mixture-of-Channels
model with the baseline's weights (the same seed, checked) and the baseline's attention:

* ``moc-masked``: the MLP's own forward, a dense ``W_down`` GEMM over the masked activations
  (what training computes; every ``W_down`` read once per step);
* ``moc-sparse``: each token's ``K`` kept rows of ``W_down`` gathered from a row-major copy and
  one ``K``-long product per token (:mod:`epas_megatron.inference.moc_decode`; ``b * K * h``
  values read per layer and step).

Both run the same gate/up projection and Top-K; what differs is only the ``W_down`` product. The
bytes of ``W_down`` each reads per step and per token are reported beside their tokens/s.

Reported with the measured ratios: the byte-limit ratio (bytes moved per step, baseline over
EPAS; :mod:`epas_megatron.inference.decode_cost`) and measured / limit; KV-cache bytes per token
(from the allocated caches); and a fixed-memory serving figure: the largest batch whose caches
fit ``--kv-budget-mb`` (default: what the baseline needs at ``--batch``) for the baseline and for
EPAS, with tokens/s measured at those batches. Last line: ``BENCH {json}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

import torch

from epas_megatron.config.presets import get_preset
from epas_megatron.errors import ConfigError
from epas_megatron.model.moc_sizes import MoCSettings, check_moc_config, kept_channels

MAX_SERVING_BATCH = 64
"""Upper bound on the serving figure's batch (memory on a CPU machine)."""


@dataclass(frozen=True)
class DecodeBenchConfig:
    """What ``epas-bench decode`` measures."""

    preset: str
    """Model preset."""

    region: int
    """Sharing layers of the EPAS variants (the deepest ones)."""

    batch: int = 8
    """Sequences decoded together."""

    context: int = 2048
    """Cached positions every timed step attends over."""

    new_tokens: int = 16
    """Timed decode steps per block."""

    blocks: int = 4
    """Alternating timed blocks per variant."""

    warmup: int = 1
    """Untimed decode steps per variant first."""

    share: str = "qk"
    """'qk' or 'kv'."""

    kv_budget_mb: Optional[float] = None
    """KV-cache budget of the serving figure (None: the baseline's cache at ``batch``)."""

    region_kernel: Optional[str] = None
    """Also time reuse with the region's cached ``P · V`` in one launch ('torch' or 'triton')."""

    seed: int = 1234
    """Initialisation seed (every variant gets the same weights)."""

    decode_step: str = "auto"
    """'eager', 'static' or 'cuda-graph' for every variant; 'auto': 'cuda-graph' on CUDA, 'eager'
    elsewhere (:mod:`epas_megatron.inference.decode_step`)."""

    moc_topk: float = 1.0
    """Below 1: also time a Mixture-of-Channels model keeping this fraction of its MLP channels
    (dense-masked and sparse-read decode steps; see the module notes)."""

    moc_groups: int = 8
    """Mixture-of-Channels channel groups (``--moc-groups``)."""

    tie_embeddings: bool = False
    """The LM head shares the input embedding's weight (``--tie-embeddings``; the presets untie
    them, as LLaMA does). A step's bytes are the same either way: the head reads one ``[v, h]``
    matrix, the embedding only the ``b`` rows of the new tokens."""


@dataclass
class _Variant:
    step: Callable
    """One decode step: ``step(tokens [b, 1])`` at ``cache.length``."""

    cache: object
    tokens: torch.Tensor
    context: int
    static: Optional[object] = None
    """The :class:`StaticDecodeStep` behind ``step``, if any."""


def _decode_block(variant: _Variant) -> None:
    """One timed unit: rewind to ``context`` and decode one step."""
    variant.cache.length = variant.context
    variant.step(variant.tokens)


def check_config(cfg: DecodeBenchConfig, num_layers: int) -> None:
    """Bad settings, before any model is built."""
    if not 0 < cfg.region < num_layers:
        raise ConfigError(f"--region must be between 1 and {num_layers - 1} for the {cfg.preset} preset")
    for name in ("batch", "context", "new_tokens", "blocks"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if cfg.kv_budget_mb is not None and cfg.kv_budget_mb <= 0:
        raise ConfigError("--kv-budget-mb must be > 0")
    if cfg.moc_topk != 1.0:
        check_moc_config(cfg.moc_topk, cfg.moc_groups, get_preset(cfg.preset).ffn_hidden_size, 1, "local")


def _variant(model, attention, kernel, batch, cfg, vocab, mode, generator, moc_decode="masked"):
    from epas_megatron.inference.decode_step import StaticDecodeStep
    from epas_megatron.inference.engine import DecodeEngine

    engine = DecodeEngine(model, attention, kernel, moc_decode)
    cache = engine.new_cache(batch, cfg.context + 1)
    # random K and V drawn in place on the device (no host copy of the cache)
    device_generator = torch.Generator(device=engine.device).manual_seed(int(torch.randint(2**31, (1,), generator=generator)))
    for buffer in (cache.computing_keys, cache.computing_values, cache.sharing_values):
        buffer.normal_(generator=device_generator)
    tokens = torch.randint(0, vocab, (batch, 1), generator=generator).to(engine.device)
    cache.length = cfg.context
    if mode == "eager":
        return _Variant(lambda t: engine.forward(t, cache), cache, tokens, cfg.context)
    static = StaticDecodeStep(engine, cache, graph=mode == "cuda-graph")
    return _Variant(static, cache, tokens, cfg.context, static)


def _same_step_everywhere(variants: dict, mode: str, log) -> str:
    """If a capture failed for some variant, run every variant's fixed-shape step without a graph."""
    if mode != "cuda-graph" or all(v.static.captured for v in variants.values()):
        return mode
    log("note: a CUDA graph capture failed; every variant runs the fixed-shape step without a graph")
    for variant in variants.values():
        variant.static.drop_graph()
    return "static"


def run_decode_bench(cfg: DecodeBenchConfig, log=print) -> dict:
    """Measure the variants (call inside an initialised world of one process)."""
    from epas_megatron.assembly import plan_for_preset
    from epas_megatron.bench.common import alternating_throughput
    from epas_megatron.inference.decode_cost import decode_bytes_per_step, max_batch_for_budget
    from epas_megatron.inference.decode_step import resolve_decode_step
    from epas_megatron.inference.kv_cache import kv_bytes_per_token
    from epas_megatron.model.attention import split_qkv_rows
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.wrapping import unwrap_model
    from epas_megatron.sharing.shape import layer_modes, region_layers

    preset = get_preset(cfg.preset)
    check_config(cfg, preset.num_layers)
    cuda = torch.cuda.is_available()
    # room for the context and the generated token
    plans = {name: plan_for_preset(cfg.preset, layers, seq_length=cfg.context, max_length=cfg.context + 1, share=cfg.share,
                                   tie_embeddings=cfg.tie_embeddings)
             for name, layers in (("baseline", ()), ("epas", region_layers(preset.num_layers, cfg.region, flag="--region")))}
    arch, precision, sharing = plans["epas"].arch, plans["epas"].precision, plans["epas"].sharing_layers
    mode = resolve_decode_step(cfg.decode_step, torch.device("cuda" if cuda else "cpu"))
    moc = cfg.moc_topk < 1.0
    if moc:  # region 0, the baseline's shape with Mixture-of-Channels MLPs
        plans["moc"] = replace(plans["baseline"], options=(MoCSettings(cfg.moc_topk, cfg.moc_groups),))
    models = {name: build_model(plan, seed=cfg.seed).chunks[0].eval() for name, plan in plans.items()}
    if moc:
        _check_same_mlp_weights(unwrap_model(models["baseline"]), unwrap_model(models["moc"]))
    # Same weights: the first sharing layer's own projection is the baseline layer's rows of it.
    first = sharing[0]
    baseline, epas = (unwrap_model(models[name]).decoder.layers[first].self_attention for name in ("baseline", "epas"))
    fused = baseline.linear_qkv.weight
    part = "v" if cfg.share == "qk" else "q"
    rows = split_qkv_rows(fused, ("q", "k", "v"), arch.num_query_groups, arch.num_attention_heads // arch.num_query_groups,
                          arch.head_dim)[part]
    if not torch.equal(rows, epas.own_projection.weight):
        raise RuntimeError("the baseline and EPAS models were built with different weights")

    generator = torch.Generator().manual_seed(cfg.seed)
    attentions = [("baseline", models["baseline"], "qk", None), ("qk", models["epas"], "qk", None)]
    if cfg.share == "qk":
        attentions.append(("reuse", models["epas"], "reuse", None))
        if cfg.region_kernel is not None:
            attentions.append(("reuse+kernel", models["epas"], "reuse", cfg.region_kernel))
    else:
        log("note: --share kv has no probability reuse (a KV-sharing layer has its own Q); reuse is not measured")
    variants = {name: _variant(model, attention, kernel, cfg.batch, cfg, arch.vocab_size, mode, generator)
                for name, model, attention, kernel in attentions}
    if moc:
        for moc_decode in ("masked", "sparse"):
            variants[f"moc-{moc_decode}"] = _variant(models["moc"], "qk", None, cfg.batch, cfg, arch.vocab_size, mode, generator,
                                                     moc_decode)
    mode = _same_step_everywhere(variants, mode, log)
    element = 4 if precision == "fp32" else 2
    attention_text = (f"matmul attention: Q K^T of {precision} operands to fp32 scores, fp32 softmax, P.V in {precision} with fp32 "
                      "accumulation" if precision != "fp32" else "matmul attention in fp32")
    log(f"decode bench: {cfg.preset} ({arch.num_layers} layers, h {arch.hidden_size}, {arch.num_attention_heads}/"
        f"{arch.num_query_groups} heads), region {cfg.region} {list(sharing)} ({cfg.share}), batch {cfg.batch}, context "
        f"{cfg.context}, {cfg.new_tokens} decode steps per block, {cfg.blocks} blocks; preallocated in-place KV cache, "
        f"{attention_text}, {mode} decode step, {precision} on {'CUDA' if cuda else 'CPU'}"
        + (f"; Mixture-of-Channels at region 0: top {kept_channels(arch.ffn_hidden_size, cfg.moc_groups, cfg.moc_topk)} of "
           f"{arch.ffn_hidden_size // cfg.moc_groups} channels in each of {cfg.moc_groups} groups" if moc else ""))
    tps = alternating_throughput(variants, cfg.batch, iters=cfg.new_tokens * cfg.blocks, blocks=cfg.blocks,
                                 warmup=cfg.warmup, log=log, step=_decode_block)

    modes = {"baseline": layer_modes(arch.num_layers, ()), "epas": layer_modes(arch.num_layers, sharing)}
    step_bytes = {name: decode_bytes_per_step(arch, modes["baseline" if name == "baseline" else "epas"], cfg.share,
                                              "reuse" if name.startswith("reuse") else "qk", cfg.batch, cfg.context, element)
                  for name in variants if not name.startswith("moc")}
    per_token = {name: kv_bytes_per_token(modes[name], cfg.share, arch.num_query_groups, arch.head_dim, element) for name in modes}
    for name, variant in variants.items():
        allocated = variant.cache.nbytes // (cfg.batch * variant.cache.max_length)
        expected = per_token["baseline" if name == "baseline" or name.startswith("moc") else "epas"]
        if allocated != expected:
            raise RuntimeError(f"{name}: the cache holds {allocated} bytes per token, the formula says {expected}")
    del variants

    budget = int(cfg.kv_budget_mb * 2**20) if cfg.kv_budget_mb else per_token["baseline"] * cfg.batch * cfg.context
    max_batch = {name: min(MAX_SERVING_BATCH, max_batch_for_budget(budget, per_token[name], cfg.context)) for name in modes}
    serving = {}
    if min(max_batch.values()) >= 1:
        serving_variants = {
            "baseline": _variant(models["baseline"], "qk", None, max_batch["baseline"], cfg, arch.vocab_size, mode, generator),
            "epas": _variant(models["epas"], "reuse" if cfg.share == "qk" else "qk", None, max_batch["epas"], cfg, arch.vocab_size, mode,
                             generator),
        }
        _same_step_everywhere(serving_variants, mode, log)
        log(f"fixed KV budget {budget / 2**20:.0f} MiB: baseline batch {max_batch['baseline']}, EPAS batch {max_batch['epas']}")
        steps_per_s = alternating_throughput(serving_variants, 1, iters=cfg.new_tokens * cfg.blocks, blocks=cfg.blocks,
                                             warmup=cfg.warmup, log=lambda *a: None, step=_decode_block)
        serving = {name: steps_per_s[name] * max_batch[name] for name in serving_variants}

    best = "reuse" if "reuse" in tps else "qk"
    record = {
        "preset": cfg.preset, "region": cfg.region, "share": cfg.share, "batch": cfg.batch, "context": cfg.context,
        "new_tokens": cfg.new_tokens, "blocks": cfg.blocks, "tie_embeddings": cfg.tie_embeddings,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "precision": precision, "cache": "preallocated in-place", "decode_step": mode,
        "attention": "matmul, fp32 scores and softmax" + (", bf16 operands" if cuda else ""),
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
    if moc:
        record.update(_moc_record(cfg, arch, tps, element, step_bytes["baseline"].total))
    log(format_table(record))
    return record


def _check_same_mlp_weights(baseline, moc) -> None:
    """The Mixture-of-Channels model was built with the baseline's weights (the same seed)."""
    for dense_layer, moc_layer in zip(baseline.decoder.layers, moc.decoder.layers):
        for name in ("linear_fc1", "linear_fc2"):
            if not torch.equal(getattr(dense_layer.mlp, name).weight, getattr(moc_layer.mlp, name).weight):
                raise RuntimeError("the baseline and Mixture-of-Channels models were built with different weights")


def _moc_record(cfg: DecodeBenchConfig, arch, tps: dict, element: int, step_bytes: int) -> dict:
    """The Mixture-of-Channels fields of the record: tokens/s, ratios, ``W_down`` bytes and the
    sparse read's byte limit (``step_bytes``: what the baseline's -- and the dense-masked -- step
    moves, :mod:`epas_megatron.inference.decode_cost`; the sparse step moves that with its
    ``W_down`` bytes in place of the whole matrices)."""
    from epas_megatron.inference.moc_decode import down_bytes_per_step

    down = down_bytes_per_step(arch.num_layers, arch.hidden_size, arch.ffn_hidden_size, cfg.moc_groups, cfg.moc_topk, cfg.batch,
                               element)
    return {
        "moc_topk": cfg.moc_topk, "moc_groups": cfg.moc_groups, "moc_per_group": arch.ffn_hidden_size // cfg.moc_groups,
        "moc_kept": kept_channels(arch.ffn_hidden_size, cfg.moc_groups, cfg.moc_topk),
        "moc_masked_tokens_per_s": tps["moc-masked"], "moc_sparse_tokens_per_s": tps["moc-sparse"],
        "ratio_moc_masked": tps["moc-masked"] / tps["baseline"], "ratio_moc_sparse": tps["moc-sparse"] / tps["baseline"],
        "ratio_moc_sparse_over_masked": tps["moc-sparse"] / tps["moc-masked"],
        "w_down_bytes_per_step_masked": down.masked, "w_down_bytes_per_step_sparse": down.sparse,
        "w_down_bytes_per_token_masked": down.masked / cfg.batch, "w_down_bytes_per_token_sparse": down.sparse / cfg.batch,
        "w_down_read_ratio": down.sparse / down.masked,
        "byte_limit_ratio_moc_sparse": step_bytes / (step_bytes - down.masked + down.sparse),
    }


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
    if "moc_topk" in record:
        rows += [f"\nMixture-of-Channels at region 0, top {record['moc_kept']} of {record['moc_per_group']} channels in each of "
                 f"{record['moc_groups']} groups (W_down bytes read by the decode step):",
                 "| variant | tokens/s | vs baseline | vs dense-masked | byte limit | W_down bytes/step | W_down bytes/token |",
                 "|---|---|---|---|---|---|---|"]
        for name, label in (("masked", "MoC, dense-masked W_down GEMM"), ("sparse", "MoC, sparse read of the kept W_down rows")):
            rows.append(f"| {label} | {record[f'moc_{name}_tokens_per_s']:.1f} | {record[f'ratio_moc_{name}']:.3f} | "
                        f"{record[f'moc_{name}_tokens_per_s'] / record['moc_masked_tokens_per_s']:.3f} | "
                        f"{1.0 if name == 'masked' else record['byte_limit_ratio_moc_sparse']:.3f} | "
                        f"{record[f'w_down_bytes_per_step_{name}']} | {record[f'w_down_bytes_per_token_{name}']:.0f} |")
    if record["serving_tokens_per_s_baseline"] is not None:
        rows.append(f"\nfixed KV budget {record['kv_budget_bytes'] / 2**20:.0f} MiB: baseline batch "
                    f"{record['max_batch_baseline']} at {record['serving_tokens_per_s_baseline']:.1f} tokens/s, EPAS batch "
                    f"{record['max_batch_epas']} at {record['serving_tokens_per_s_epas']:.1f} tokens/s "
                    f"({record['serving_tokens_per_s_epas'] / record['serving_tokens_per_s_baseline']:.3f}x)")
    return "\n".join(rows)
