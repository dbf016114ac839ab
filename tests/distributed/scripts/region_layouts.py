"""Under torchrun (2 processes): one training step of an 8-layer model for every sharing-region
size 0..7 under several pipeline layouts, plus one region that ends before the last layer
(--epas-exclude-last: layers 3-5 share, 6-7 compute) and regions of several blocks (--epas-blocks);
prints one RESULT line per (layout, region, exclude_last, blocks) from rank 0.

The data-parallel layout (PP=1, DP=2) is the reference: with a per-token loss over the global
batch it computes exactly what one process computes."""

import json
import sys

import torch
import torch.distributed as dist

from epas_megatron.runtime.distributed import init_distributed, seed_everything

LAYOUTS = {
    "pp1": dict(pp=1),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "uneven_6_2": dict(pp=2, layout="Etttttt|ttL"),
    "uneven_1_7": dict(pp=2, layout="Et|tttttttL"),
    "uneven_vpp_2_3_1_2": dict(pp=2, layout="Ett|ttt|t|ttL"),
}
GLOBAL_BATCH, SEQ = 4, 32
REGIONS = [(size, 0, 1) for size in range(8)] + [(3, 2, 1), (4, 0, 2), (6, 0, 2), (4, 0, 4)]
"""(region size, exclude_last, blocks): every region at the deep end; layers 3-5 with a computing
tail -- under pp2 the region crosses the stage boundary and the tail receives the hand-off, under
uneven_6_2 a boundary lies right after the region (no hand-off); and --epas-blocks regions: two
blocks 2-3 and 6-7 (sources 1 and 5: uneven_vpp_2_3_1_2's boundaries before layers 2 and 6 each
carry a different source's hand-off), 1-3 and 5-7 (sources 0 and 4), four one-layer blocks 1, 3,
5, 7 (sources 0, 2, 4, 6)."""


def batches(dp_rank, dp_size, vocab):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    for i in range(GLOBAL_BATCH // dp_size):
        t = tokens[i * dp_size + dp_rank: i * dp_size + dp_rank + 1]
        yield {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(1, SEQ),
               "position_ids": torch.arange(SEQ).unsqueeze(0)}


def main():
    from megatron.core import parallel_state

    from epas_megatron.engine.optimizer import OptimizerSettings, build_optimizer, build_scheduler, wrap_ddp
    from epas_megatron.engine.step import train_step
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.model.stage_layout import StageLayout
    from epas_megatron.sharing.shape import RegionShape, region_layers

    only = sys.argv[1:] or list(LAYOUTS)
    arch = LlamaArchitecture(8, 64, 4, 2, 176, 256, SEQ, init_method_std=0.2)
    settings = OptimizerSettings(lr=1e-3, min_lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=0.0, use_distributed_optimizer=False, overlap_grad_reduce=False,
                                 warmup_iters=0, decay_iters=10, decay_style="constant")
    init_distributed(1, 1, None, seed=0)
    for name in only:
        spec = LAYOUTS[name]
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=spec["pp"],
            virtual_pipeline_model_parallel_size=spec.get("vpp") or (2 if spec.get("layout", "").count("|") == 3 else None))
        seed_everything(0)
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        for region, exclude_last, blocks in REGIONS:
            sharing = region_layers(8, region, exclude_last=exclude_last, blocks=blocks)
            layout = StageLayout.from_layout_string(spec["layout"], spec["pp"]) if "layout" in spec else None
            plan = BuildPlan.for_region(arch, sharing, seq_length=SEQ, pp=spec["pp"], vpp=spec.get("vpp"), layout=layout,
                                        shape=RegionShape(8, exclude_last, blocks))
            built = build_model(plan, seed=7)
            seq = built.schedule_seq_length
            model = wrap_ddp(built.chunks, built.config, settings)
            optimizer = build_optimizer(model, settings)
            scheduler = build_scheduler(optimizer, settings)
            iterators = [batches(dp_rank, dp, arch.vocab_size) for _ in model]
            result = train_step(model, optimizer, scheduler, iterators, num_microbatches=GLOBAL_BATCH // dp,
                                seq_length=seq, micro_batch_size=1)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"layout": name, "region": region, "exclude_last": exclude_last, "blocks": blocks,
                                              "loss": result.lm_loss,
                                              "grad_norm": result.grad_norm, "p2p_rows": seq}), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
