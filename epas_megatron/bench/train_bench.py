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
import statistics
import time
from dataclasses import dataclass

import torch


@dataclass
class TrainBenchConfig:
    """What to measure."""

    preset: str
    """Model preset."""

    region: int
    """Sharing layers of the EPAS model (the deepest ones)."""

    iters: int
    """Timed iterations per model (split into blocks)."""

    blocks: int
    """Alternating timed blocks per model."""

    warmup: int
    """Untimed iterations per model before timing."""

    seq_length: int
    """Sequence length."""

    micro_batch_size: int
    """Micro-batch size."""

    num_microbatches: int
    """Micro-batches per iteration."""

    tp: int
    """Tensor-parallel size."""

    pp: int
    """Pipeline-parallel size."""

    share: str = "qk"
    """'qk' or 'kv'."""

    seed: int = 1234
    """Initialisation seed (both models get the same weights)."""


class _Synthetic:
    """Endless micro-batches of random tokens (the same sequence for both models)."""

    def __init__(self, vocab: int, seq: int, batch: int, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq, self.batch = vocab, seq, batch

    def __iter__(self):
        return self

    def __next__(self):
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.g)
        return {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(self.batch, self.seq),
            "position_ids": torch.arange(self.seq).expand(self.batch, -1),
        }


def _build(cfg: TrainBenchConfig, arch, sharing, bf16: bool, backend: str):
    from epas_megatron.model.builder import build_model_chunks, make_transformer_config, pipeline_handoff_rows
    from epas_megatron.model.specs import layer_roles
    from epas_megatron.training.optimizer import OptimizerSettings, build_optimizer, build_scheduler, wrap_ddp

    config = make_transformer_config(arch, tp=cfg.tp, pp=cfg.pp, bf16=bf16)
    chunks = build_model_chunks(config, arch, sharing, backend=backend, share=cfg.share, seed=cfg.seed)
    hidden_rows, total_rows, schedule_seq = pipeline_handoff_rows(config, layer_roles(arch.num_layers, sharing), cfg.seq_length, cfg.share)
    for chunk in chunks:
        chunk.decoder.set_p2p_rows(hidden_rows, total_rows)
    settings = OptimizerSettings(lr=1e-4, min_lr=1e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=1.0, bf16=bf16, use_distributed_optimizer=torch.cuda.is_available(),
                                 overlap_grad_reduce=False, warmup_iters=1, decay_iters=10**6, decay_style="constant")
    model = wrap_ddp(chunks, config, settings)
    optimizer = build_optimizer(model, settings)
    return {"model": model, "optimizer": optimizer, "scheduler": build_scheduler(optimizer, settings), "seq": schedule_seq}


def _step(state, data, cfg: TrainBenchConfig) -> None:
    from epas_megatron.training.step import train_step

    train_step(state["model"], state["optimizer"], state["scheduler"], data,
               num_microbatches=cfg.num_microbatches, seq_length=state["seq"], micro_batch_size=cfg.micro_batch_size)


def _timed(state, data, cfg, iters: int) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        _step(state, data, cfg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def run_train_bench(cfg: TrainBenchConfig, log=print) -> dict:
    """Measure both models; returns the BENCH record (call inside an initialised process group)."""
    import torch.distributed as dist

    from epas_megatron.config.presets import get_preset
    from epas_megatron.metrics.flops import Convention, flop_limit_ratio
    from epas_megatron.model.builder import LlamaArchitecture, padded_vocab_size
    from epas_megatron.sharing.schedule import region_layers

    preset = get_preset(cfg.preset)
    vocab = padded_vocab_size(preset.vocab_size or 8192)
    arch = LlamaArchitecture(preset.num_layers, preset.hidden_size, preset.num_attention_heads, preset.num_query_groups,
                             preset.ffn_hidden_size, vocab, max(cfg.seq_length, preset.seq_length))
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    cuda = torch.cuda.is_available()
    backend = "transformer_engine" if cuda and _have_te() else "local"
    states = {"baseline": _build(cfg, arch, (), cuda, backend), "epas": _build(cfg, arch, sharing, cuda, backend)}
    dp = dist.get_world_size() // (cfg.tp * cfg.pp)
    tokens_per_iter = cfg.seq_length * cfg.micro_batch_size * cfg.num_microbatches * dp
    # One identical stream per model chunk (interleaved schedules read each chunk's own).
    data = {name: [_Synthetic(arch.vocab_size, cfg.seq_length, cfg.micro_batch_size, cfg.seed + 1) for _ in state["model"]]
            for name, state in states.items()}
    log(f"bench: {cfg.preset} ({arch.num_layers} layers, h {arch.hidden_size}), region {cfg.region} {list(sharing)}, "
        f"seq {cfg.seq_length}, {cfg.num_microbatches} x {cfg.micro_batch_size} x DP {dp}, TP {cfg.tp}, PP {cfg.pp}, "
        f"{backend} layers, {'bf16 CUDA' if cuda else 'fp32 CPU'}; {cfg.warmup} warm-up + {cfg.iters} timed iterations each")
    for name, state in states.items():
        for _ in range(cfg.warmup):
            _step(state, data[name], cfg)
    per_block = max(1, cfg.iters // cfg.blocks)
    times = {name: [] for name in states}
    for block in range(cfg.blocks):
        order = ["baseline", "epas"] if block % 2 == 0 else ["epas", "baseline"]
        for name in order:
            times[name].append(_timed(states[name], data[name], cfg, per_block))
        log(f"  block {block + 1}/{cfg.blocks}: baseline {tokens_per_iter / times['baseline'][-1]:9.1f} tok/s, "
            f"epas {tokens_per_iter / times['epas'][-1]:9.1f} tok/s")
    tps = {name: tokens_per_iter / statistics.median(t) for name, t in times.items()}
    convention = Convention.MEGATRON if backend == "transformer_engine" else Convention.PAPER
    limit = flop_limit_ratio(arch.flops_shape(cfg.seq_length), cfg.region, share=cfg.share, convention=convention)
    ratio = tps["epas"] / tps["baseline"]
    record = {
        "preset": cfg.preset, "region": cfg.region, "seq_length": cfg.seq_length, "tp": cfg.tp, "pp": cfg.pp,
        "baseline_tokens_per_s": tps["baseline"], "epas_tokens_per_s": tps["epas"], "ratio": ratio,
        "flop_limit_ratio": limit, "measured_over_limit": ratio / limit, "flop_convention": convention.name.lower(),
        "backend": backend, "blocks": cfg.blocks, "iters_per_block": per_block,
    }
    log(f"baseline {tps['baseline']:.1f} tok/s | EPAS {tps['epas']:.1f} tok/s | ratio {ratio:.4f} | "
        f"FLOP limit {limit:.4f} | measured/limit {ratio / limit:.4f}")
    return record


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def format_record(record: dict) -> str:
    """The machine-readable last line."""
    return "BENCH " + json.dumps(record)
