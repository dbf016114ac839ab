"""The training the executor tests run on both sides of a comparison (the project's executor with a
schedule's action lists, or Megatron-Core's own schedule with ``schedule=None``): a model built
from one seed, the same synthetic micro-batches per chunk, a few training steps and one
forward-only step. Imported by tests/training/scripts/executor_*.py (under torchrun)."""

from epas_megatron.bench.common import BENCH_OPTIMIZER, SyntheticTokens
from epas_megatron.engine.optimizer import OptimizerSettings
from epas_megatron.engine.state import build_training_state
from epas_megatron.engine.step import eval_step, train_step

SEQ, BATCH, MICROBATCHES, ITERATIONS = 32, 2, 4, 3


def train_and_evaluate(plan, schedule, microbatches: int = MICROBATCHES):
    """(per-iteration [loss, grad norm], the forward-only step's loss, the training state). fp16
    starts from a loss scale of 2^8, low enough for this tiny model's steps not to overflow."""
    extra = {"initial_loss_scale": 2.0**8} if plan.precision == "fp16" else {}
    settings = OptimizerSettings(precision=plan.precision, use_distributed_optimizer=False, **BENCH_OPTIMIZER, **extra)
    state = build_training_state(plan, settings, seed=5)
    data = [SyntheticTokens(plan.arch.vocab_size, SEQ, BATCH, seed=9) for _ in state.model]
    records = []
    for _ in range(ITERATIONS):
        result = train_step(state.model, state.optimizer, state.scheduler, data, num_microbatches=microbatches,
                            seq_length=state.schedule_seq_length, micro_batch_size=BATCH, pipeline_schedule=schedule)
        records.append([result.lm_loss, result.grad_norm])
    valid = eval_step(state.model, data, num_microbatches=microbatches, seq_length=state.schedule_seq_length,
                      micro_batch_size=BATCH, pipeline_schedule=schedule)
    return records, valid.lm_loss, state
