"""Under torchrun (2 processes, TP=2): the activation bytes one micro-batch's forward keeps per
layer on each rank, without and with sequence parallelism, qk and kv sharing; rank 0 prints one
RESULT line per case."""

import json

import torch
import torch.distributed as dist

from epas_megatron.metrics.activation_memory import measure_saved_bytes
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.builder import build_model
from epas_megatron.runtime.distributed import init_distributed

S, B = 48, 2


def main():
    init_distributed(2, 1, None, seed=1)
    arch = LlamaArchitecture(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=352,
                             vocab_size=512, max_sequence_length=S)
    for sequence_parallel in (False, True):
        for share in ("qk", "kv"):
            plan = BuildPlan.for_region(arch, (2, 3), seq_length=S, tp=2, sequence_parallel=sequence_parallel, share=share)
            model = build_model(plan, seed=1).chunks[0]
            tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
            got = measure_saved_bytes(model, tokens, torch.arange(S).expand(B, S), None, labels=tokens)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, got.layers)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"sequence_parallel": sequence_parallel, "share": share,
                                              "layers_per_rank": [{str(k): v for k, v in r.items()} for r in everyone]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
