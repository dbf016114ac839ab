"""``epas-bench pipeline``: what stage rebalancing buys EPAS under pipeline parallelism.

Run under torchrun with PP ranks (CPU: ``torchrun --nproc-per-node 2``). In one process group,
from the same weights and synthetic tokens, it times (alternating blocks, medians):

* ``baseline``: no sharing, Megatron's even split;
* ``epas_norebalance``: the deepest ``--region`` layers share, even split kept;
* ``epas_rebalanced``: the same region, layers re-partitioned by the planner;
* ``baseline_rebalanced``: no sharing, the planner's layout for it (what rebalancing alone buys,
  e.g. for the LM head on the last stage), so EPAS's own share of the gain is visible;
* ``pp1``: baseline and EPAS with PP=1 (data parallel over the same ranks), the gain that
  rebalancing tries to keep under PP.

It also times each stage's compute alone (forward + backward of the rank's chunk on synthetic
input, no communication) for every variant, and prints the cost model's prediction for 7B on
PP=4 and PP=8 (half the layers sharing) with and without rebalancing. Last line:
``BENCH {json}`` with ``baseline_tokens_per_s``, ``epas_norebalance_tokens_per_s``,
``epas_rebalanced_tokens_per_s``, the PP=1 numbers, and ``rebalanced_gain_retained`` = (PP
rebalanced gain - 1) / (PP=1 gain - 1).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from epas_megatron.bench.common import BenchConfig


def _stage_compute_seconds(variant, hidden_size: int, repeats: int = 3) -> float:
    """Forward + backward of this rank's chunks alone on synthetic input (no communication)."""
    from epas_megatron.runtime.device import compute_device, synchronize, to_compute_device
    from epas_megatron.runtime.wrapping import unwrap_model

    total = 0.0
    for chunk, data in zip(variant.state.model, variant.data):
        module = unwrap_model(chunk)
        rows = module.decoder.p2p_rows[1] if module.decoder.p2p_rows else data.seq
        times = []
        for _ in range(repeats + 1):
            batch = to_compute_device(next(data))
            if not module.pre_process:
                # What the previous stage would send: [rows, b, h] in the pipeline's dtype.
                received = torch.randn(rows, data.batch, hidden_size, device=compute_device(),
                                       dtype=module.config.pipeline_dtype, requires_grad=True)
                module.set_input_tensor(received)
            synchronize()
            start = time.perf_counter()
            out = module(batch["tokens"], batch["position_ids"], None, labels=batch["labels"] if module.post_process else None)
            out.backward(torch.ones_like(out) if module.post_process else torch.randn_like(out))
            synchronize()
            times.append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
            chunk.zero_grad_buffer()
        total += statistics.median(times[1:])  # the first repeat warms up
    return total


def _predicted_7b_table(log) -> list[dict]:
    from epas_megatron.config.presets import get_preset
    from epas_megatron.model.architecture import architecture_from_preset
    from epas_megatron.parallel.layout_report import predict_pipeline_speedup
    from epas_megatron.parallel.stage_layouts import flops_layer_costs

    p7 = get_preset("7b")
    arch = architecture_from_preset(p7)
    costs = flops_layer_costs(arch, p7.seq_length)
    rows = []
    log("predicted for 7b (32 layers, seq 2048), 16 sharing layers, bottleneck model:")
    log("| PP | EPAS gain, even split | EPAS gain, rebalanced | rebalancing alone (no EPAS) | total-FLOP ratio |")
    log("|---|---|---|---|---|")
    for pp in (4, 8):
        s = predict_pipeline_speedup(costs, arch.num_layers, pp, 1, 16)
        rows.append({"pp": pp, "gain_even_split": s.speedup_without_rebalancing, "gain_rebalanced": s.speedup_with_rebalancing,
                     "gain_rebalancing_only": s.baseline_bottleneck / s.baseline_rebalanced_bottleneck, "ideal": s.ideal_speedup})
        log(f"| {pp} | {s.speedup_without_rebalancing:.4f} | {s.speedup_with_rebalancing:.4f} | "
            f"{s.baseline_bottleneck / s.baseline_rebalanced_bottleneck:.4f} | {s.ideal_speedup:.4f} |")
    log("(gains above the total-FLOP ratio come from the baseline's imbalance: the LM head makes the "
        "last stage the slowest, and the cheaper sharing layers there relieve it)")
    return rows


def run_pipeline_bench(cfg: BenchConfig, log=print) -> dict:
    """Measure the variants (inside a process group of PP ranks x DP); returns the BENCH record."""
    from megatron.core import parallel_state

    from epas_megatron.assembly import plan_for_preset
    from epas_megatron.bench.common import alternating_throughput, bench_variant, default_backend
    from epas_megatron.parallel.stage_layouts import flops_layer_costs, region_layout
    from epas_megatron.runtime.distributed import seed_everything
    from epas_megatron.sharing.shape import region_layers

    arch = plan_for_preset(cfg.preset, seq_length=cfg.seq_length).arch
    sharing = region_layers(arch.num_layers, cfg.region, flag="--region")
    costs = flops_layer_costs(arch, cfg.seq_length, cfg.share)
    rebalanced_layout = region_layout(costs, arch.num_layers, cfg.pp, cfg.vpp, sharing)
    baseline_layout = region_layout(costs, arch.num_layers, cfg.pp, cfg.vpp, ())
    rebalanced, baseline_planned = rebalanced_layout.to_layout_string(), baseline_layout.to_layout_string()
    world = dist.get_world_size()
    tokens = cfg.seq_length * cfg.micro_batch_size * cfg.num_microbatches * (world // cfg.pp)
    log(f"bench pipeline: {cfg.preset}, region {cfg.region} {list(sharing)}, PP {cfg.pp}"
        f"{f' VPP {cfg.vpp}' if cfg.vpp else ''}, {cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} x seq {cfg.seq_length}; "
        f"rebalanced layout {rebalanced}")
    timing = dict(iters=cfg.iters, blocks=cfg.blocks, warmup=cfg.warmup, log=log)
    settings = dict(seq_length=cfg.seq_length, share=cfg.share, backend=default_backend(), core_attention=cfg.core_attention)

    def variant(sharing_layers, num_microbatches, **parallel):
        plan = plan_for_preset(cfg.preset, sharing_layers, **settings, **parallel)
        return bench_variant(plan, micro_batch_size=cfg.micro_batch_size, num_microbatches=num_microbatches, seed=cfg.seed)

    pipelined = dict(num_microbatches=cfg.num_microbatches, pp=cfg.pp, vpp=cfg.vpp)
    variants = {
        "baseline": variant((), **pipelined),
        "epas_norebalance": variant(sharing, **pipelined),
        "epas_rebalanced": variant(sharing, layout=rebalanced_layout, **pipelined),
        "baseline_rebalanced": variant((), layout=baseline_layout, **pipelined),
    }
    results = alternating_throughput(variants, tokens, **timing)
    stage = {name: _stage_compute_seconds(state, arch.hidden_size) for name, state in variants.items()}
    stage_all = {}
    for name, seconds in stage.items():
        gathered = [None] * world
        dist.all_gather_object(gathered, (parallel_state.get_pipeline_model_parallel_rank(), seconds))
        stage_all[name] = {rank: s for rank, s in sorted(set(gathered))}
    del variants

    # PP=1 over the same processes (data parallel): the gain rebalancing tries to keep.
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    seed_everything(cfg.seed)
    dp_micro = max(1, cfg.num_microbatches * cfg.pp // world)
    pp1_tokens = cfg.seq_length * cfg.micro_batch_size * dp_micro * world
    pp1 = alternating_throughput({"pp1_baseline": variant((), dp_micro), "pp1_epas": variant(sharing, dp_micro)},
                                 pp1_tokens, **timing)

    log("per-stage compute (forward+backward of one micro-batch, seconds): " + "; ".join(
        f"{name}: " + ", ".join(f"stage {r} {s:.4f}" for r, s in stages.items()) for name, stages in stage_all.items()))
    predicted = _predicted_7b_table(log)
    gain_pp1 = pp1["pp1_epas"] / pp1["pp1_baseline"]
    gain_rebal = results["epas_rebalanced"] / results["baseline"]
    gain_fixed = results["epas_norebalance"] / results["baseline"]
    retained = (gain_rebal - 1) / (gain_pp1 - 1) if gain_pp1 != 1 else float("nan")
    gain_own = results["epas_rebalanced"] / results["baseline_rebalanced"]
    log(f"tokens/s: baseline {results['baseline']:.1f}, EPAS even split {results['epas_norebalance']:.1f} ({gain_fixed:.4f}x), "
        f"EPAS rebalanced {results['epas_rebalanced']:.1f} ({gain_rebal:.4f}x); PP=1: {gain_pp1:.4f}x; "
        f"rebalanced keeps {retained:.1%} of the PP=1 gain; against a baseline rebalanced too ({baseline_planned}): {gain_own:.4f}x")
    return {
        "preset": cfg.preset, "region": cfg.region, "pp": cfg.pp, "vpp": cfg.vpp, "rebalanced_layout": rebalanced,
        "baseline_tokens_per_s": results["baseline"], "epas_norebalance_tokens_per_s": results["epas_norebalance"],
        "epas_rebalanced_tokens_per_s": results["epas_rebalanced"],
        "baseline_rebalanced_tokens_per_s": results["baseline_rebalanced"], "baseline_rebalanced_layout": baseline_planned,
        "gain_over_rebalanced_baseline": gain_own,
        "pp1_baseline_tokens_per_s": pp1["pp1_baseline"], "pp1_epas_tokens_per_s": pp1["pp1_epas"],
        "gain_norebalance": gain_fixed, "gain_rebalanced": gain_rebal, "gain_pp1": gain_pp1,
        "rebalanced_gain_retained": retained, "stage_compute_s": stage_all, "predicted_7b": predicted,
    }
