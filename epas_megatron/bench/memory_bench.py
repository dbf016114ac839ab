"""``epas-bench memory``: activation bytes of computing and sharing layers, measured and modelled.

One process builds the preset's model with the deepest ``--region`` layers sharing, runs one
micro-batch forward with saved-tensor hooks (:mod:`epas_megatron.metrics.activation_memory`),
and prints, per layer role, the bytes kept for backward next to
:mod:`epas_megatron.metrics.memory_model`'s prediction, the model's terms that differ between
the roles, and what the region saves on the decoder's activations (with Korthikanti et al.'s
GPT count at the same shape for scale). Last line: ``BENCH {json}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryBenchConfig:
    """One ``epas-bench memory`` invocation."""

    preset: str
    """Model preset."""

    region: int
    """Sharing layers (the deepest)."""

    seq_length: int
    """s."""

    micro_batch_size: int
    """b."""

    share: str = "qk"
    """What sharing layers reuse: 'qk' or 'kv'."""

    precision: str = "fp32"
    """'fp32' or 'bf16'."""

    seed: int = 1234
    """Weights' seed (the bytes do not depend on it)."""


def run_memory_bench(cfg: MemoryBenchConfig, log=print) -> dict:
    """Measure and model (call inside an initialised single-process group)."""
    from epas_megatron.config.presets import get_preset
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.metrics.memory_model import LayerShape, layer_activation_terms
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import LlamaArchitecture, build_model, padded_vocab_size
    from epas_megatron.runtime.device import compute_device
    from epas_megatron.sharing.schedule import region_layers

    preset = get_preset(cfg.preset)
    vocab = padded_vocab_size(preset.vocab_size or 8192)
    arch = LlamaArchitecture(preset.num_layers, preset.hidden_size, preset.num_attention_heads, preset.num_query_groups,
                             preset.ffn_hidden_size, vocab, max(cfg.seq_length, preset.seq_length))
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    plan = BuildPlan.for_region(arch, sharing, seq_length=cfg.seq_length, precision=cfg.precision, share=cfg.share)
    model = build_model(plan, seed=cfg.seed).chunks[0]
    device = compute_device()
    generator = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, vocab, (cfg.micro_batch_size, cfg.seq_length), generator=generator).to(device)
    positions = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, cfg.seq_length)
    measured = measure_saved_bytes(model, tokens, positions, None, labels=tokens)

    shape = LayerShape(arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size,
                       cfg.seq_length, cfg.micro_batch_size)
    e = 4 if cfg.precision == "fp32" else 2
    terms = {role: layer_activation_terms(shape, role, cfg.share, e) for role in ("compute", "share")}
    computing = [measured.layers[i] for i in range(arch.num_layers) if i not in sharing]
    shared = [measured.layers[i] for i in sharing]
    computing_measured, sharing_measured = max(computing), max(shared) if shared else 0
    computing_model, sharing_model = sum(terms["compute"].values()), sum(terms["share"].values())
    baseline_decoder = arch.num_layers * computing_measured
    epas_decoder = sum(measured.layers.values())
    s, b, h, a = cfg.seq_length, cfg.micro_batch_size, arch.hidden_size, arch.num_attention_heads
    korthikanti = s * b * h * (34 + 5 * a * s / h) * e / 2  # GPT, per layer, fp16 bytes scaled to e
    record = {
        "preset": cfg.preset, "region": cfg.region, "sharing_layers": list(sharing), "share": cfg.share,
        "precision": cfg.precision, "seq_length": s, "micro_batch_size": b,
        "computing_layer_bytes_measured": computing_measured, "sharing_layer_bytes_measured": sharing_measured,
        "computing_layer_bytes_model": computing_model, "sharing_layer_bytes_model": sharing_model,
        "layers_equal_within_role": len(set(computing)) <= 1 and len(set(shared)) <= 1,
        "decoder_bytes_baseline": baseline_decoder, "decoder_bytes_epas": epas_decoder,
        "decoder_saving_fraction": 1 - epas_decoder / baseline_decoder,
        "outside_layers_bytes": measured.outside,
        "model_bytes_epas": epas_decoder + measured.outside,
        "model_saving_fraction": 1 - (epas_decoder + measured.outside) / (baseline_decoder + measured.outside),
        "korthikanti_gpt_layer_bytes": korthikanti,
    }
    mb = 1 / 2**20
    log(f"bench: activation bytes kept for backward, {cfg.preset} ({arch.num_layers} layers, h {h}, {a}/{arch.num_query_groups} heads, "
        f"ffn {arch.ffn_hidden_size}), region {cfg.region} {list(sharing)} ({cfg.share}), {cfg.precision}, seq {s} x micro-batch {b}, "
        f"local layers, one micro-batch")
    log("| layer role | measured MiB | model MiB | model / measured |")
    log("|---|---:|---:|---:|")
    for role, got, want in (("computing", computing_measured, computing_model), ("sharing", sharing_measured, sharing_model)):
        log(f"| {role} | {got * mb:.3f} | {want * mb:.3f} | {want / got if got else float('nan'):.4f} |")
    differing = sorted(set(terms["compute"]) ^ set(terms["share"]) | {k for k in terms["compute"] if k in terms["share"] and terms["compute"][k] != terms["share"][k]})
    log("terms that differ (MiB, computing -> sharing): " + ", ".join(
        f"{k} {terms['compute'].get(k, 0) * mb:.3f} -> {terms['share'].get(k, 0) * mb:.3f}" for k in differing))
    log(f"decoder activations at region {cfg.region}: {epas_decoder * mb:.2f} MiB vs {baseline_decoder * mb:.2f} MiB with every layer "
        f"computing ({record['decoder_saving_fraction']:.1%} less); with the embedding, final norm and LM head "
        f"({measured.outside * mb:.2f} MiB): {record['model_saving_fraction']:.1%} less. "
        f"(Korthikanti's GPT layer at this shape: {korthikanti * mb:.3f} MiB.)")
    return record
