"""Under torchrun (4 ranks, PP=4): the V schedules on an 8-layer model (rank r holds layers r and
7-r: one layer per V stage) against Megatron-Core's 1F1B on its own placement, for m = p and
m = 2p micro-batches, with a sharing region (layers 3-7) whose hand-off crosses rank 2 -> rank 3
by p2p, the turn on rank 3, and ranks 3 -> 2 -> 1 -> 0 on the way back. Rank 0 prints one
RESULT line per case: per iteration [loss, grad norm] and the forward-only loss of both."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megatron.core import parallel_state

from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.parallel.pipeline_schedule import PIPELINE_SCHEDULES, build_schedule
from epas_megatron.runtime.distributed import init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helper

from executor_runs import SEQ as S  # noqa: E402
from executor_runs import train_and_evaluate

V_NAMES = tuple(name for name, kind in PIPELINE_SCHEDULES.items() if kind.v_placement)

P, SHARING = 4, (3, 4, 5, 6, 7)


def main():
    init_distributed(1, P, 2, seed=1)  # V placement: two chunks per rank
    arch = LlamaArchitecture(num_layers=2 * P, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=88,
                             vocab_size=128, max_sequence_length=S, init_method_std=0.2)
    ours = {}
    for microbatches in (P, 2 * P):
        for name in V_NAMES:
            plan = BuildPlan.for_region(arch, SHARING, seq_length=S, pp=P, v_stage_sizes=even_v_stage_sizes(2 * P, P))
            records, valid, _ = train_and_evaluate(plan, build_schedule(name, P, microbatches), microbatches)
            ours[(name, microbatches)] = (records, valid)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=P)
    megatron = {}
    for microbatches in (P, 2 * P):
        records, valid, _ = train_and_evaluate(BuildPlan.for_region(arch, SHARING, seq_length=S, pp=P), None, microbatches)
        megatron[microbatches] = (records, valid)
    if dist.get_rank() == 0:
        for (name, microbatches), (records, valid) in ours.items():
            print("RESULT " + json.dumps({"schedule": name, "microbatches": microbatches, "v": records, "v_valid": valid,
                                          "megatron": megatron[microbatches][0], "megatron_valid": megatron[microbatches][1]}),
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
