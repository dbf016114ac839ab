"""Under torchrun (2 ranks, PP=2): V placement (rank r holds stages r and 3-r of a 4-layer model,
embedding and loss on rank 0) run by the executor with the ``v-1f1b`` lists, against the same
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

from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.parallel.pipeline_schedule import build_schedule
from epas_megatron.runtime.distributed import init_distributed
from epas_megatron.runtime.wrapping import unwrap_model
from epas_megatron.training import pipeline_executor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helper

from executor_runs import MICROBATCHES as M  # noqa: E402
from executor_runs import SEQ as S
from executor_runs import train_and_evaluate


def run(plan, schedule):
    records, valid, state = train_and_evaluate(plan, schedule)
    layers = [[layer.layer_number - 1 for layer in unwrap_model(chunk).decoder.layers] for chunk in state.model]
    keys = {t.key for chunk in state.model for t in unwrap_model(chunk).sharded_state_dict().values()
            if hasattr(t, "key") and ".layers." in t.key}
    return {"records": records, "valid": valid, "layers": layers,
            "layer_keys": sorted({int(k.split(".layers.")[1].split(".")[0]) for k in keys})}


def main():
    init_distributed(1, 2, 2, seed=1)  # V placement: two chunks per rank
    arch = LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                             vocab_size=256, max_sequence_length=S, init_method_std=0.2)
    cases = (("plain", (), "fp32"), ("handoff", (1, 2, 3), "fp32"), ("handoff_bf16", (1, 2, 3), "bf16"),
             ("handoff_fp16", (1, 2, 3), "fp16"), ("handoff_untagged", (1, 2, 3), "fp32"))
    results = {}
    for name, sharing, precision in cases:
        plan = BuildPlan.for_region(arch, sharing, seq_length=S, pp=2, precision=precision, v_stage_sizes=even_v_stage_sizes(4, 2))
        if name.endswith("untagged"):  # every message tag 0: gloo then matches in posting order, as NCCL does
            with mock.patch.object(pipeline_executor, "_message_tag", lambda *args: 0):
                results[name] = {"v": run(plan, build_schedule("v-1f1b", 2, M))}
        else:
            results[name] = {"v": run(plan, build_schedule("v-1f1b", 2, M))}
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    for name, sharing, precision in cases:
        plan = BuildPlan.for_region(arch, sharing, seq_length=S, pp=2, precision=precision)
        results[name]["megatron"] = run(plan, None)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: (r["v"]["layers"], r["v"]["layer_keys"]) for name, r in results.items()})
    if dist.get_rank() == 0:
        for name, r in results.items():
            print("RESULT " + json.dumps({"case": name, "v": r["v"]["records"], "megatron": r["megatron"]["records"],
                                          "valid": [r["v"]["valid"], r["megatron"]["valid"]],
                                          "layers_per_rank": [e[name][0] for e in everyone],
                                          "layer_keys_per_rank": [e[name][1] for e in everyone]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
