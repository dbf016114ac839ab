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

    tp: int = 1
    """Tensor parallel size (the world: one process per TP rank; bytes are per rank)."""

    sequence_parallel: bool = False
    """With TP > 1: sequence parallelism."""


def _measure(sharing, cfg: MemoryBenchConfig, share: str, recompute: str):
    """Measured bytes of one micro-batch for one configuration (a fresh model)."""
    from epas_megatron.assembly import plan_for_preset
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.model.build_plan import RecomputeSettings
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.device import compute_device

    plan = plan_for_preset(cfg.preset, sharing, seq_length=cfg.seq_length, precision=cfg.precision, share=share,
                           recompute=RecomputeSettings(recompute), tp=cfg.tp, sequence_parallel=cfg.sequence_parallel)
    model = build_model(plan, seed=cfg.seed).chunks[0]
    arch = plan.arch
    device = compute_device()
    generator = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, arch.vocab_size, (cfg.micro_batch_size, cfg.seq_length), generator=generator).to(device)
    positions = torch.arange(cfg.seq_length, device=device).expand(cfg.micro_batch_size, cfg.seq_length)
    return measure_saved_bytes(model, tokens, positions, None, labels=tokens)


def run_memory_bench(cfg: MemoryBenchConfig, log=print) -> dict:
    """Measure and model every configuration one process can run -- ``qk`` and ``kv`` sharing,
    without and with selective recompute -- (call inside an initialised single-process group).
    The record's top-level figures are ``cfg.share`` without recompute."""
    from epas_megatron.assembly import memory_kernels
    from epas_megatron.config.presets import get_preset
    from epas_megatron.metrics.memory_model import LayerShape, layer_activation_terms
    from epas_megatron.model.architecture import architecture_from_preset
    from epas_megatron.model.fusions import KernelAvailability
    from epas_megatron.sharing.schedule import region_layers

    preset = get_preset(cfg.preset)
    arch = architecture_from_preset(preset, cfg.seq_length)
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    shape = LayerShape(arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size,
                       cfg.seq_length, cfg.micro_batch_size)
    e = 4 if cfg.precision == "fp32" else 2
    # The model as the kernels of this device keep it (CPU: composite norm, unfused SwiGLU; with
    # Transformer Engine installed, fused RoPE -- as the builder sets it for these local layers).
    parallel = dict(tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, **memory_kernels(KernelAvailability.detect()))
    s, b, h, a = cfg.seq_length, cfg.micro_batch_size, arch.hidden_size, arch.num_attention_heads
    mb = 1 / 2**20
    log(f"bench: activation bytes kept for backward, {cfg.preset} ({arch.num_layers} layers, h {h}, {a}/{arch.num_query_groups} heads, "
        f"ffn {arch.ffn_hidden_size}), region {cfg.region} {list(sharing)}, {cfg.precision}, seq {s} x micro-batch {b}, "
        f"local layers, one micro-batch, TP {cfg.tp}{' with sequence parallelism' if cfg.sequence_parallel else ''} (bytes per rank)")
    log("| sharing | recompute | layer | measured MiB | model MiB | model / measured |")
    log("|---|---|---|---:|---:|---:|")
    configurations = []
    record = {}
    for share in (cfg.share, "kv" if cfg.share == "qk" else "qk"):
        for recompute in ("none", "selective"):
            measured = _measure(sharing, cfg, share, recompute)
            computing = [measured.layers[i] for i in range(arch.num_layers) if i not in sharing]
            shared = [measured.layers[i] for i in sharing]
            row = {"share": share, "recompute": recompute,
                   "computing_layer_bytes_measured": max(computing), "sharing_layer_bytes_measured": max(shared),
                   "computing_layer_bytes_model": sum(layer_activation_terms(shape, "compute", share, e, recompute=recompute,
                                                                             **parallel).values()),
                   "sharing_layer_bytes_model": sum(layer_activation_terms(shape, "share", share, e, recompute=recompute,
                                                                           **parallel).values()),
                   "layers_equal_within_role": len(set(computing)) <= 1 and len(set(shared)) <= 1,
                   "decoder_bytes_baseline": arch.num_layers * max(computing), "decoder_bytes_epas": sum(measured.layers.values()),
                   "outside_layers_bytes": measured.outside}
            configurations.append(row)
            for role in ("computing", "sharing"):
                got, want = row[f"{role}_layer_bytes_measured"], row[f"{role}_layer_bytes_model"]
                log(f"| {share} | {recompute} | {role} | {got * mb:.3f} | {want * mb:.3f} | {want / got:.4f} |")
            if share == cfg.share and recompute == "none":
                record = dict(row)
    terms = {role: layer_activation_terms(shape, role, cfg.share, e, **parallel) for role in ("compute", "share")}
    differing = sorted(set(terms["compute"]) ^ set(terms["share"]))
    log(f"terms that differ ({cfg.share}, MiB, computing -> sharing): " + ", ".join(
        f"{k} {terms['compute'].get(k, 0) * mb:.3f} -> {terms['share'].get(k, 0) * mb:.3f}" for k in differing))
    baseline, epas, outside = record["decoder_bytes_baseline"], record["decoder_bytes_epas"], record["outside_layers_bytes"]
    korthikanti = s * b * h * (34 + 5 * a * s / h) * e / 2  # GPT, per layer, fp16 bytes scaled to e
    record.update(preset=cfg.preset, region=cfg.region, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, sharing_layers=list(sharing),
                  precision=cfg.precision, seq_length=s,
                  micro_batch_size=b, decoder_saving_fraction=1 - epas / baseline,
                  model_saving_fraction=1 - (epas + outside) / (baseline + outside), korthikanti_gpt_layer_bytes=korthikanti,
                  configurations=configurations)
    log(f"decoder activations at region {cfg.region} ({cfg.share}): {epas * mb:.2f} MiB vs {baseline * mb:.2f} MiB with every layer "
        f"computing ({record['decoder_saving_fraction']:.1%} less); with the embedding, final norm and LM head "
        f"({outside * mb:.2f} MiB): {record['model_saving_fraction']:.1%} less. (Korthikanti's GPT layer at this shape: "
        f"{korthikanti * mb:.3f} MiB.)")
    return record
