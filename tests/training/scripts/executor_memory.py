"""Under torchrun (``p`` ranks, default 4): the activation bytes each pipeline rank keeps for
backward, measured through one training iteration of every schedule the executor runs --
``1f1b`` on Megatron's placement and ``v-1f1b``, ``v-half``, ``v-min`` on V placement -- with
:class:`~epas_megatron.metrics.activation_memory.LiveSavedBytes` (saved tensors while autograd
keeps them, and what the split backward's deferred weight-gradient GEMMs hold from ``B`` to
``W``). A ``2p``-layer model (one layer per V stage), fp32, no sharing. Rank 0 prints one RESULT
line per schedule: each rank's peak bytes and what was still held after the iteration (0).

    torchrun --nproc-per-node 4 tests/training/scripts/executor_memory.py [P] [MICROBATCHES]
"""

import json
import sys

import torch.distributed as dist

from megatron.core import parallel_state

from epas_megatron.bench.common import BENCH_OPTIMIZER, SyntheticTokens
from epas_megatron.engine.optimizer import OptimizerSettings
from epas_megatron.engine.state import build_training_state
from epas_megatron.engine.step import train_step
from epas_megatron.metrics.activation_memory import LiveSavedBytes
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.parallel.pipeline_schedule import V_SCHEDULES, build_schedule
from epas_megatron.runtime.distributed import init_distributed

SEQ, BATCH = 32, 2
ARCH = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176, vocab_size=256)


def measure(plan, schedule) -> tuple[int, int]:
    """(peak bytes, bytes still held after the iteration) of this rank through one iteration."""
    settings = OptimizerSettings(precision=plan.precision, use_distributed_optimizer=False, **BENCH_OPTIMIZER)
    state = build_training_state(plan, settings, seed=5)
    data = [SyntheticTokens(plan.arch.vocab_size, SEQ, BATCH, seed=9) for _ in state.model]
    tracker = LiveSavedBytes(p for chunk in state.model for p in chunk.parameters())
    with tracker.tracking():
        train_step(state.model, state.optimizer, state.scheduler, data, num_microbatches=schedule.microbatches,
                   seq_length=state.schedule_seq_length, micro_batch_size=BATCH, pipeline_schedule=schedule)
    return tracker.peak, tracker.current


def main():
    pp = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    microbatches = int(sys.argv[2]) if len(sys.argv) > 2 else 2 * pp
    arch = LlamaArchitecture(num_layers=2 * pp, max_sequence_length=SEQ, **ARCH)
    init_distributed(1, pp, 2, seed=1)  # V placement: two chunks per rank
    mine = {}
    for name in V_SCHEDULES:
        plan = BuildPlan.for_region(arch, (), seq_length=SEQ, pp=pp, v_stage_sizes=even_v_stage_sizes(2 * pp, pp))
        mine[name] = measure(plan, build_schedule(name, pp, microbatches))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    mine["1f1b"] = measure(BuildPlan.for_region(arch, (), seq_length=SEQ, pp=pp), build_schedule("1f1b", pp, microbatches))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        for name in ("1f1b", *V_SCHEDULES):
            print("RESULT " + json.dumps({"schedule": name, "pp": pp, "microbatches": microbatches, "seq": SEQ, "batch": BATCH,
                                          "layers": 2 * pp, **ARCH, "peak_per_rank": [e[name][0] for e in everyone],
                                          "left_per_rank": [e[name][1] for e in everyone]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
