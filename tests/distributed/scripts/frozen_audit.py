"""Run under torchrun (DP=2, overlapped gradient reduction): train through EPAS switches and
report (one JSON file per rank in the output directory) where frozen Q/K weights are (they must be in no optimizer group, no DDP
bucket, have no gradient) and whether they moved after their switch."""

import json
import sys

import torch
import torch.distributed as dist

from epas_megatron.config.cli import parse_config
from epas_megatron.training.trainer import Trainer
from epas_megatron.validation import resolve_run


def main(argv):
    trainer = Trainer(resolve_run(parse_config(argv)))
    trainer.setup()
    snapshots = {}
    original_switch = trainer.apply_switch

    def switch_and_snapshot(sharing):
        info = original_switch(sharing)
        for name, p in trainer.model[0].module.named_parameters():
            if not p.requires_grad and name not in snapshots:
                snapshots[name] = p.detach().clone()
        return info

    trainer.apply_switch = switch_and_snapshot
    try:
        trainer.train()
        module = trainer.model[0].module
        frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
        in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
        in_buckets = {id(p) for p in trainer.model[0].param_to_bucket_group}
        report = {
            "rank": dist.get_rank(),
            "frozen": sorted(frozen),
            "in_optimizer": sorted(n for n, p in frozen.items() if id(p) in in_optimizer),
            "in_ddp_buckets": sorted(n for n, p in frozen.items() if id(p) in in_buckets),
            "with_grad": sorted(n for n, p in frozen.items() if p.grad is not None or hasattr(p, "main_grad")),
            "moved_after_switch": sorted(n for n, p in frozen.items() if not torch.equal(p, snapshots[n])),
            "trainable_in_buckets": all(id(p) in in_buckets for p in module.parameters() if p.requires_grad),
            "overlap_grad_reduce": trainer.model[0].ddp_config.overlap_grad_reduce,
        }
        # One file per rank: two ranks printing to one pipe can interleave their lines.
        out = trainer.out / f"audit_rank{dist.get_rank()}.json"
        out.write_text(json.dumps(report))
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
