"""Under torchrun (``p`` ranks, default 4): the activation bytes each pipeline rank keeps for
backward, measured through one training iteration of every schedule the executor runs --
``1f1b`` on Megatron's placement and ``v-1f1b``, ``v-half``, ``v-min`` on V placement -- with
:class:`~epas_megatron.metrics.activation_memory.LiveSavedBytes` (saved tensors while autograd
keeps them, and what the split backward's deferred weight-gradient GEMMs hold from ``B`` to
``W``). A ``2p``-layer model (one layer per V stage), fp32, no sharing. Also the pipeline messages
the executor sends: each sent tensor is held from its ``batch_isend_irecv`` until the executor
drops the call's ``Work`` (a sent stage output lives exactly that long: its activation was freed
after the send) -- alone, and together with the saved bytes. Rank 0 prints one RESULT line per
schedule: each rank's peak bytes, what was still held after the iteration (0), the peak of sent
bytes, the peak of both together and one message's bytes.

    torchrun --nproc-per-node 4 tests/training/scripts/executor_memory.py [P] [MICROBATCHES]
"""

import contextlib
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron.core import parallel_state

from epas_megatron.bench.common import BENCH_OPTIMIZER, SyntheticTokens
from epas_megatron.engine.optimizer import OptimizerSettings
from epas_megatron.engine.state import build_training_state
from epas_megatron.engine.step import train_step
from epas_megatron.metrics.activation_memory import LiveSavedBytes
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE
from epas_megatron.parallel.pipeline_schedule import PIPELINE_SCHEDULES, build_schedule
from epas_megatron.runtime.distributed import init_distributed

V_NAMES = tuple(name for name, kind in PIPELINE_SCHEDULES.items() if kind.v_placement)

SEQ, BATCH = 32, 2
ARCH = dict(hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=176, vocab_size=256)


class _HeldWork:
    """A ``Work`` that also holds the tensors its call sent, in the trackers, until it is dropped."""

    def __init__(self, work, holds):
        self.work, self.holds = work, holds

    def wait(self, *args):
        return self.work.wait(*args)

    def is_completed(self):
        return self.work.is_completed()


@contextlib.contextmanager
def tracking(saved: LiveSavedBytes, sent: LiveSavedBytes, both: LiveSavedBytes):
    """Saved tensors (and what deferred weight-gradient GEMMs keep) into ``saved`` and ``both``;
    sent pipeline tensors, while their works live, into ``sent`` and ``both``."""
    post, send = dist.batch_isend_irecv, dist.isend

    def batch_isend_irecv(ops):
        holds = [tracker.hold(op.tensor) for op in ops if op.op in (isend, send) for tracker in (sent, both)]
        for op in ops:  # what runs the batch sees the send it knows (torch's own tells sends by c10d.isend)
            if op.op is isend:
                op.op = send
        dist.isend = c10d.isend = send
        try:
            works = post(ops)
        finally:
            dist.isend = c10d.isend = isend
        return [_HeldWork(work, holds) for work in works]

    def isend(tensor, *args, **kwargs):  # an unbatched send (the executor has none; a control would)
        return _HeldWork(send(tensor, *args, **kwargs), [tracker.hold(tensor) for tracker in (sent, both)])

    def pack(tensor):
        return saved.hold(tensor), both.hold(tensor)

    WEIGHT_GRAD_STORE.on_put = lambda tensors: (saved.hold_all(tensors), both.hold_all(tensors))
    dist.batch_isend_irecv = batch_isend_irecv
    dist.isend = c10d.isend = isend  # (P2POp accepts c10d's own isend only)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: LiveSavedBytes._unpack(packed[0])):
            yield
    finally:
        dist.batch_isend_irecv = post
        dist.isend = c10d.isend = send
        WEIGHT_GRAD_STORE.on_put = None


def measure(plan, schedule) -> tuple[int, int, int, int]:
    """This rank through one iteration: (peak saved bytes, saved bytes still held after it, peak
    sent bytes held, peak of both together)."""
    settings = OptimizerSettings(precision=plan.precision, use_distributed_optimizer=False, **BENCH_OPTIMIZER)
    state = build_training_state(plan, settings, seed=5)
    data = [SyntheticTokens(plan.arch.vocab_size, SEQ, BATCH, seed=9) for _ in state.model]
    parameters = [p for chunk in state.model for p in chunk.parameters()]
    saved, sent, both = LiveSavedBytes(parameters), LiveSavedBytes(parameters), LiveSavedBytes(parameters)
    with tracking(saved, sent, both):
        train_step(state.model, state.optimizer, state.scheduler, data, num_microbatches=schedule.microbatches,
                   seq_length=state.schedule_seq_length, micro_batch_size=BATCH, pipeline_schedule=schedule)
    return saved.peak, saved.current, sent.peak, both.peak


def main():
    pp = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    microbatches = int(sys.argv[2]) if len(sys.argv) > 2 else 4 * pp
    arch = LlamaArchitecture(num_layers=2 * pp, max_sequence_length=SEQ, **ARCH)
    init_distributed(1, pp, 2, seed=1)  # V placement: two chunks per rank
    mine = {}
    for name in V_NAMES:
        plan = BuildPlan.for_region(arch, (), seq_length=SEQ, pp=pp, v_stage_sizes=even_v_stage_sizes(2 * pp, pp))
        mine[name] = measure(plan, build_schedule(name, pp, microbatches))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    mine["1f1b"] = measure(BuildPlan.for_region(arch, (), seq_length=SEQ, pp=pp), build_schedule("1f1b", pp, microbatches))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        for name in ("1f1b", *V_NAMES):
            print("RESULT " + json.dumps({"schedule": name, "pp": pp, "microbatches": microbatches, "seq": SEQ, "batch": BATCH,
                                          "layers": 2 * pp, **ARCH, "peak_per_rank": [e[name][0] for e in everyone],
                                          "left_per_rank": [e[name][1] for e in everyone],
                                          "sent_peak_per_rank": [e[name][2] for e in everyone],
                                          "both_peak_per_rank": [e[name][3] for e in everyone],
                                          "message_bytes": SEQ * BATCH * ARCH["hidden_size"] * 4}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
