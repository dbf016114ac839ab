"""Under torchrun (2 ranks, PP=2): V placement (rank r holds stages r and 3-r of a 4-layer model,
embedding and loss on rank 0) run by the executor with the ``v-1f1b`` lists (and ``v-half`` /
``v-min``, whose weight-gradient GEMMs are deferred to their W passes), against the same
model on Megatron's placement under Megatron-Core's 1F1B (itself equal to one process:
tests/distributed): per iteration the loss and the gradient norm, and a forward-only step; also
each chunk's global layer ids and the checkpoint keys of its layers. Cases: no sharing; a region
whose hand-off crosses rank 1 -> the turn -> rank 0 (layers 1-3 share layer 0's Q/K); bf16; fp16
(dynamic loss scaling); and that region with every message tagged 0 (matched in posting order, as NCCL does: v-1f1b takes
messages in another order than they are sent, so the executor posts receives in the senders').
Rank 0 prints one RESULT line per case."""

import json
import sys
from pathlib import Path
from unittest import mock

import torch.distributed as dist

from megatron.core import parallel_state

from epas_megatron.engine import pipeline_executor
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE
from epas_megatron.parallel.pipeline_schedule import build_schedule
from epas_megatron.runtime.distributed import init_distributed
from epas_megatron.runtime.wrapping import unwrap_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helper

from executor_runs import MICROBATCHES as M  # noqa: E402
from executor_runs import SEQ as S
from executor_runs import train_and_evaluate


def run(plan, schedule):
    deferred = WEIGHT_GRAD_STORE.computed
    records, valid, state = train_and_evaluate(plan, schedule)
    deferred = WEIGHT_GRAD_STORE.computed - deferred
    layers = [[layer.layer_number - 1 for layer in unwrap_model(chunk).decoder.layers] for chunk in state.model]
    keys = {t.key for chunk in state.model for t in unwrap_model(chunk).sharded_state_dict().values()
            if hasattr(t, "key") and ".layers." in t.key}
    return {"records": records, "valid": valid, "layers": layers, "deferred_gemms": deferred,
            "layer_keys": sorted({int(k.split(".layers.")[1].split(".")[0]) for k in keys})}


def main():
    init_distributed(1, 2, 2, seed=1)  # V placement: two chunks per rank
    arch = LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                             vocab_size=256, max_sequence_length=S, init_method_std=0.2)
    cases = (("plain", (), "fp32", "v-1f1b"), ("handoff", (1, 2, 3), "fp32", "v-1f1b"), ("handoff_bf16", (1, 2, 3), "bf16", "v-1f1b"),
             ("handoff_fp16", (1, 2, 3), "fp16", "v-1f1b"), ("handoff_untagged", (1, 2, 3), "fp32", "v-1f1b"),
             ("handoff_v-half", (1, 2, 3), "fp32", "v-half"), ("handoff_v-min", (1, 2, 3), "fp32", "v-min"),
             ("handoff_bf16_v-min", (1, 2, 3), "bf16", "v-min"), ("handoff_fp16_v-half", (1, 2, 3), "fp16", "v-half"),
             ("handoff_v-min_untagged", (1, 2, 3), "fp32", "v-min"))
    results = {}
    for name, sharing, precision, schedule in cases:
        plan = BuildPlan.for_region(arch, sharing, seq_length=S, pp=2, precision=precision, v_stage_sizes=even_v_stage_sizes(4, 2))
        if name.endswith("untagged"):  # every message tag 0: gloo then matches in posting order, as NCCL does
            with mock.patch.object(pipeline_executor, "_message_tag", lambda *args: 0):
                results[name] = {"v": run(plan, build_schedule(schedule, 2, M))}
        else:
            results[name] = {"v": run(plan, build_schedule(schedule, 2, M))}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    references = {}
    for name, sharing, precision, _ in cases:
        if (sharing, precision) not in references:
            plan = BuildPlan.for_region(arch, sharing, seq_length=S, pp=2, precision=precision)
            references[(sharing, precision)] = run(plan, None)
        results[name]["megatron"] = references[(sharing, precision)]
    everyone = [None] * dist.get_world_size()
    mine = {name: (r["v"]["layers"], r["v"]["layer_keys"], r["v"]["deferred_gemms"]) for name, r in results.items()}
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        for name, r in results.items():
            print("RESULT " + json.dumps({"case": name, "v": r["v"]["records"], "megatron": r["megatron"]["records"],
                                          "valid": [r["v"]["valid"], r["megatron"]["valid"]],
                                          "layers_per_rank": [e[name][0] for e in everyone],
                                          "layer_keys_per_rank": [e[name][1] for e in everyone],
                                          "deferred_gemms_per_rank": [e[name][2] for e in everyone]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
