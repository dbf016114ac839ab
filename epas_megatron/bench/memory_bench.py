"""``epas-bench memory``: activation bytes of computing and sharing layers, measured and modelled.

One process builds the preset's model with the deepest ``--region`` layers sharing, runs one
micro-batch forward with saved-tensor hooks (:mod:`epas_megatron.metrics.activation_memory`),
and prints, per layer role, the bytes kept for backward next to
:mod:`epas_megatron.metrics.memory_model`'s prediction, the model's terms that differ between
the roles, and what the region saves on the decoder's activations (with Korthikanti et al.'s
GPT count at the same shape for scale). Then the MLP's own choices for a computing layer, measured
and modelled: the dense MLP, Megatron-Core's MLP recompute (``--recompute-modules mlp``: one more
MLP forward in backward) and Mixture-of-Channels (``--moc-topk``: the sparse form, no extra GEMM
FLOPs, another model), with the bytes each saves and the FLOPs it costs. Last line:
``BENCH {json}``.
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

    moc_topk: float = 0.2
    """Mixture-of-Channels kept fraction of the MLP comparison (the paper's K)."""

    moc_groups: int = 8
    """Mixture-of-Channels channel groups (a multiple of ``tp``)."""


def _measure(sharing, cfg: MemoryBenchConfig, share: str, recompute: str, modules=("core_attn",), moc=None):
    """Measured bytes of one micro-batch for one configuration (a fresh model): selective
    recompute of ``modules``; Mixture-of-Channels ``moc`` (a ``MoCSettings``)."""
    from epas_megatron.assembly import plan_for_preset
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.model.build_plan import RecomputeSettings
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.device import compute_device

    recompute_settings = RecomputeSettings(recompute, modules=tuple(modules)) if recompute == "selective" else RecomputeSettings(recompute)
    plan = plan_for_preset(cfg.preset, sharing, seq_length=cfg.seq_length, precision=cfg.precision, share=share,
                           recompute=recompute_settings, tp=cfg.tp, sequence_parallel=cfg.sequence_parallel, moc=moc)
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
    from epas_megatron.metrics.memory_model import layer_activation_terms
    from epas_megatron.model.architecture import ModelShape, architecture_from_preset
    from epas_megatron.model.fusions import KernelAvailability
    from epas_megatron.sharing.shape import region_layers

    preset = get_preset(cfg.preset)
    arch = architecture_from_preset(preset, cfg.seq_length)
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    shape = ModelShape(arch, cfg.seq_length, cfg.micro_batch_size)
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
    record["mlp_choices"] = _mlp_choices(sharing, cfg, shape, e, parallel, log)
    return record


def _mlp_choices(sharing, cfg: MemoryBenchConfig, shape, e: int, parallel: dict, log) -> dict:
    """A computing layer's bytes with the dense MLP, MLP recompute and Mixture-of-Channels, measured
    and modelled, with the extra forward FLOPs each costs per micro-batch (one TP rank)."""
    from epas_megatron.metrics.memory_model import layer_activation_bytes
    from epas_megatron.model.moc_sizes import MoCSettings

    s, b, h, f = cfg.seq_length, cfg.micro_batch_size, shape.hidden_size, shape.ffn_hidden_size // cfg.tp
    moc = MoCSettings(cfg.moc_topk, cfg.moc_groups)
    choices = {
        "dense": (dict(recompute="none"), {}, 0),
        "mlp_recompute": (dict(recompute="selective", modules=("mlp",)), dict(recompute="selective", recompute_modules=("mlp",)),
                          2 * s * b * 3 * h * f),  # fc1 (h -> 2f) and fc2 (f -> h) again, 2 FLOPs a multiply-add
        "moc": (dict(recompute="none", moc=moc), dict(moc=moc), 0),
    }
    rows = {}
    for name, (measure_kw, model_kw, flops) in choices.items():
        measured = _measure(sharing, cfg, "qk", **measure_kw)
        computing = max(measured.layers[i] for i in range(len(measured.layers)) if i not in sharing)
        rows[name] = {"layer_bytes_measured": computing, "layer_bytes_model": layer_activation_bytes(shape, "compute", "qk", e,
                                                                                                    **parallel, **model_kw),
                      "extra_forward_flops": flops}
    dense = rows["dense"]["layer_bytes_measured"]
    mb = 1 / 2**20
    log(f"MLP choices, one computing layer, one micro-batch (Mixture-of-Channels: top {cfg.moc_topk:g} of the channels in "
        f"{cfg.moc_groups} groups; it changes the model -- its quality is measured by epas-bench quality --parts moc):")
    log("| MLP | measured MiB | model MiB | saved vs dense | extra GFLOP per micro-batch | MiB saved per extra GFLOP |")
    log("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        saved = dense - row["layer_bytes_measured"]
        row["saved_fraction"] = saved / dense
        per_gflop = saved * mb / (row["extra_forward_flops"] / 1e9) if row["extra_forward_flops"] else None
        row["mib_saved_per_extra_gflop"] = per_gflop
        log(f"| {name} | {row['layer_bytes_measured'] * mb:.3f} | {row['layer_bytes_model'] * mb:.3f} | {saved / dense:.1%} | "
            f"{row['extra_forward_flops'] / 1e9:.3f} | {'no extra FLOPs' if per_gflop is None else f'{per_gflop:.3f}'} |")
    return rows
