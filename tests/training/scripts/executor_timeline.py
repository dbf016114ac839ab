"""Under torchrun (2 ranks, PP=2): the executor's timeline recorder on real runs. For ``1f1b``
(Megatron's placement) and ``v-half`` (V placement, B/W split), no sharing: the shared executor
training (three steps and a forward-only step, tests/executor_runs.py) once without recording
and once inside ``record_timelines`` from the same seed. Rank 0 prints one RESULT line per
schedule: both runs' losses and gradient norms, whether every parameter is equal after them on
each rank, and every rank's recorded timelines (actions, start and end times, p2p messages and
bytes) with the bubble the module computes for each iteration."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from epas_megatron.engine import pipeline_executor
from epas_megatron.engine.pipeline_executor import executed_bubble, record_timelines
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.parallel.pipeline_schedule import build_schedule
from epas_megatron.runtime.distributed import init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helper

from executor_runs import MICROBATCHES as M  # noqa: E402
from executor_runs import SEQ as S
from executor_runs import train_and_evaluate


def main():
    init_distributed(1, 2, None, seed=1)
    arch = LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176,
                             vocab_size=256, max_sequence_length=S, init_method_std=0.2)
    for name in ("1f1b", "v-half"):
        sizes = even_v_stage_sizes(4, 2) if name != "1f1b" else None
        plan = BuildPlan.for_region(arch, (), seq_length=S, pp=2, v_stage_sizes=sizes)
        schedule = build_schedule(name, 2, M)
        records_off, valid_off, state_off = train_and_evaluate(plan, schedule)
        assert pipeline_executor._RECORDING is None
        with record_timelines() as timelines:
            records_on, valid_on, state_on = train_and_evaluate(plan, schedule)
        assert pipeline_executor._RECORDING is None
        same = all(torch.equal(a, b) for chunk_off, chunk_on in zip(state_off.model, state_on.model)
                   for a, b in zip(chunk_off.parameters(), chunk_on.parameters()))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (same, timelines))
        if dist.get_rank() == 0:
            per_rank = [[{"actions": [str(a) for a in t.actions], "start": t.start, "end": t.end,
                          "sent_messages": t.sent_messages, "sent_bytes": t.sent_bytes,
                          "received_messages": t.received_messages, "received_bytes": t.received_bytes,
                          "bubble": t.bubble} for t in rank_timelines] for _, rank_timelines in everyone]
            bubbles = [executed_bubble([rank_timelines[i] for _, rank_timelines in everyone]) for i in range(len(timelines))]
            print("RESULT " + json.dumps({"schedule": name, "off": records_off, "on": records_on, "valid": [valid_off, valid_on],
                                          "same_params_per_rank": [e[0] for e in everyone], "timelines": per_rank,
                                          "bubbles": bubbles,
                                          "lists": [[str(a) for a in actions] for actions in schedule.ranks]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
