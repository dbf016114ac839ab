"""Under torchrun (2 ranks, PP=2): the project's executor running the ``1f1b`` action lists of
parallel/pipeline_schedule.py against Megatron-Core's own 1F1B schedule, on two models built from
the same seed and fed the same micro-batches: per iteration the loss, the gradient norm and every
parameter after the optimizer step; also a forward-only (evaluation) step. Cases: no sharing,
a region whose hand-off crosses the stage boundary (layers 1-3 share layer 0's Q/K), that region
in bf16, and the same lists in GPipe's order. Rank 0 prints one RESULT line per case."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.parallel.pipeline_schedule import Action, ScheduleActions, build_schedule, check_actions
from epas_megatron.runtime.distributed import init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helper

from executor_runs import MICROBATCHES as M  # noqa: E402
from executor_runs import SEQ as S
from executor_runs import train_and_evaluate


def run(plan, schedule):
    records, valid, state = train_and_evaluate(plan, schedule)
    return records, valid, [p.detach().float().clone() for p in state.model[0].parameters()]


def main():
    init_distributed(1, 2, None, seed=1)
    arch = LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                             vocab_size=256, max_sequence_length=S, init_method_std=0.2)
    schedule = build_schedule("1f1b", 2, M)
    # Any valid lists run: GPipe's order (every forward, then every backward) -- the same numbers.
    gpipe = ScheduleActions("1f1b", 2, M, tuple(tuple([Action("F", r, i) for i in range(M)] + [Action("BW", r, i) for i in range(M)])
                                               for r in range(2)))
    check_actions(gpipe)
    cases = (("plain", (), "fp32", schedule), ("handoff", (1, 2, 3), "fp32", schedule), ("handoff_bf16", (1, 2, 3), "bf16", schedule),
             ("handoff_gpipe_order", (1, 2, 3), "fp32", gpipe))
    for name, sharing, precision, lists in cases:
        plan = BuildPlan.for_region(arch, sharing, seq_length=S, pp=2, precision=precision)
        megatron = run(plan, None)
        ours = run(plan, lists)
        same_params = all(torch.equal(a, b) for a, b in zip(megatron[2], ours[2]))
        max_diff = max(float((a - b).abs().max()) for a, b in zip(megatron[2], ours[2]))
        flags = [same_params, max_diff]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, flags)
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({"case": name, "megatron": megatron[0], "ours": ours[0], "valid": [megatron[1], ours[1]],
                                          "same_params_per_rank": [e[0] for e in everyone],
                                          "max_param_diff_per_rank": [e[1] for e in everyone]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
