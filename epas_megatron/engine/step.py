"""One training or evaluation step through Megatron-Core's pipeline schedules.

The loss is the per-token mean over the whole global batch (all micro-batches, all data-parallel
ranks): the model returns per-token losses, the loss function returns their masked sum and token
count, and with ``calculate_per_token_loss`` Megatron divides the gradients by the global token
count. Reported losses are reduced the same way, so they do not depend on DP, TP, PP or the
micro-batch split.

Data iterators yield CPU tensors (pinned with a GPU) of what the chunk's pipeline stage uses
(:func:`stage_batch_keys`); :func:`forward_step` moves each micro-batch to the model's device
(:func:`epas_megatron.runtime.device.to_compute_device`, asynchronous from pinned memory) before
anything touches it. ``sample_ids`` stay on the host: they only key Random-LTD's token draws.

**A non-finite step stops the run** (:class:`~epas_megatron.errors.NonFiniteError`), with the
semantics of Megatron-LM's ``--check-for-nan-in-loss-and-grad`` (on by default there): the loss
of the global batch is checked *before* the optimizer step, so a NaN or Inf forward never
updates the weights; the gradient norm (bf16 and fp32) right after the step -- the step that
produced it is never saved. Megatron checks each rank's loss and each gradient bucket before the
data-parallel reduction, to name a faulty rank; here the reduced values are checked, which every
rank sees alike, so all ranks stop at the same iteration without another collective. In fp16 an
overflowing step is the loss scaler's business (skipped, the scale lowered, as Megatron does),
not an error; a non-finite fp16 *loss* still is. Loss spikes (Megatron's optional
``--check-for-spiky-loss``) do not stop a run: Megatron's check is off by default and exists to
catch silent hardware faults by re-running the iteration on the same data (its rerun state
machine), which a plain threshold cannot tell from a real spike -- and an EPAS switch causes a
legitimate, recovering jump in the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from epas_megatron.errors import NonFiniteError
from epas_megatron.runtime.device import to_compute_device
from epas_megatron.runtime.wrapping import unwrap_model


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """(masked loss sum, token count, {'lm loss': [sum, count]}) for Megatron's schedules."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    reported = torch.stack([loss_sum.detach().clone(), mask.sum().detach()])
    return loss_sum, num_tokens, {"lm loss": reported}


def stage_batch_keys(chunk) -> tuple[str, ...]:
    """The batch entries a model chunk uses: tokens and positions where it embeds (the first
    stage), labels and the loss mask where it computes the loss (the last), sample ids always."""
    model = unwrap_model(chunk)
    keys = ("tokens", "position_ids") if model.pre_process else ()
    keys += ("labels", "loss_mask") if model.post_process else ()
    return (*keys, "sample_ids")


def forward_step(data_iterator, model):
    """Megatron forward_step_func: next micro-batch -> model output and its loss function."""
    batch = next(data_iterator)
    sample_ids = batch.pop("sample_ids", None)  # [b], host: keys Random-LTD's draws
    batch = to_compute_device(batch)
    output = model(batch.get("tokens"), batch.get("position_ids"), None, labels=batch.get("labels"), sample_ids=sample_ids)
    return output, partial(loss_func, batch.get("loss_mask"))


@dataclass
class StepResult:
    """What one step returns."""

    lm_loss: float
    """Per-token mean loss of the global batch."""

    tokens: int
    """Loss tokens in the global batch (the loss mask's ones, each counted once whatever the
    tensor-parallel size)."""

    grad_norm: Optional[float] = None
    """Global gradient norm before clipping (training steps)."""

    update_successful: bool = True
    """False if the optimizer skipped the update (inf/nan)."""

    loss_scale: Optional[float] = None
    """fp16: the loss scale used for this step's gradients (None otherwise)."""


def _loss_totals(losses: Sequence[dict]) -> torch.Tensor:
    """``[loss sum, tokens]`` (fp64) of this rank's micro-batches, summed where they are (on the
    GPU: no host copy per micro-batch), then over all ranks.

    Only the ranks of the stage with the loss hold losses, and every tensor-parallel rank of it
    holds the same copy (the vocab-parallel loss is whole on each): only the first TP rank's
    count, so each token counts once and the sum is the global batch's. (Summing every TP rank's
    copy scaled the sum and the count alike: the ratio was right, the count ``tp`` times too big.)
    """
    from epas_megatron.runtime.distributed import all_reduce_tensor, collective_device

    if losses and _first_tensor_parallel_rank():
        # [m, 2] -> [2]
        total = torch.stack([entry["lm loss"].detach() for entry in losses]).to(collective_device(), torch.float64).sum(0)
    else:
        total = torch.zeros(2, dtype=torch.float64, device=collective_device())
    return all_reduce_tensor(total)


def _first_tensor_parallel_rank() -> bool:
    """Whether this rank is its tensor-parallel group's first (True without Megatron's groups)."""
    return not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_rank() == 0


def _host_values(*tensors: torch.Tensor) -> list[float]:
    """The values of small device tensors on the host, in ONE copy (one synchronisation)."""
    return torch.cat([t.detach().reshape(-1).to(tensors[0].device, torch.float64) for t in tensors]).tolist()


def _loss_and_tokens(totals: list[float]) -> tuple[float, int]:
    loss_sum, tokens = totals
    return loss_sum / max(tokens, 1.0), int(round(tokens))


def _schedule_iterators(data_iterators: Sequence[Iterator]):
    return data_iterators[0] if len(data_iterators) == 1 else list(data_iterators)


def _run_schedule(model_chunks, data_iterators, num_microbatches, seq_length, micro_batch_size, forward_only, schedule=None):
    """Megatron-Core's schedule for the chunks (1F1B, interleaved), or the action lists of
    ``schedule`` (a :class:`~epas_megatron.parallel.pipeline_schedule.ScheduleActions`) on the
    project's executor."""
    if schedule is not None:
        from epas_megatron.engine.pipeline_executor import run_pipeline_schedule

        if schedule.microbatches != num_microbatches:
            raise ValueError(f"the schedule is for {schedule.microbatches} micro-batches, the step runs {num_microbatches}")
        return run_pipeline_schedule(schedule, model_chunks, data_iterators, forward_step_func=forward_step, seq_length=seq_length,
                                     micro_batch_size=micro_batch_size, forward_only=forward_only)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=_schedule_iterators(data_iterators),
        model=list(model_chunks),
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def scale_lr(optimizer, scheduler, factor: Optional[float]) -> None:
    """Set every parameter group's LR to the scheduler's LR at its current count times ``factor``
    (what the scheduler's own step sets, scaled: with 1, exactly its value); ``None``: nothing is
    touched."""
    if factor is None:
        return
    for group in optimizer.param_groups:
        lr = scheduler.get_lr(group) * factor
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def train_step(model_chunks, optimizer, scheduler, data_iterators, *, num_microbatches: int, seq_length: int, micro_batch_size: int,
               lr_increment: int = 1, lr_factor: Optional[float] = None, next_lr_factor: Optional[float] = None,
               pipeline_schedule=None) -> StepResult:
    """Forward/backward over a global batch, optimizer step, LR schedule step.

    ``seq_length`` is what Megatron's schedules size p2p tensors with (see
    ``BuiltModel.schedule_seq_length``). ``lr_increment``: how far the LR schedule advances
    (1 iteration; the step's layer tokens under Random-LTD's LayerToken LR). ``lr_factor``: the
    step runs with the scheduler's LR times it; ``next_lr_factor``: the next step's, set on the
    parameter groups after the schedule's step (so they hold, and the logs show, the LR the next
    step uses; also after a skipped fp16 step, whose LR count stands still). None (the default):
    the scheduler's LR untouched (``--epas-switch-rewarm``, :mod:`epas_megatron.sharing.rewarm`).
    ``pipeline_schedule``: run these action lists instead of Megatron-Core's schedule."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = _run_schedule(model_chunks, data_iterators, num_microbatches, seq_length, micro_batch_size, False, pipeline_schedule)
    # The step's one host copy before the optimizer: the global loss and tokens (the loss must be
    # checked before the weights move) and, in fp16, the loss scale these gradients were made with.
    totals = _loss_totals(losses)
    scale = optimizer.get_loss_scale() if model_chunks[0].config.fp16 else None
    values = _host_values(totals, scale) if scale is not None else _host_values(totals)
    loss, tokens = _loss_and_tokens(values[:2])
    loss_scale = values[2] if scale is not None else None
    if not math.isfinite(loss):  # before the step: the weights stay as they were
        raise NonFiniteError(f"the loss is {loss} (the weights were not updated)")
    scale_lr(optimizer, scheduler, lr_factor)  # a fresh value from the scheduler: right after a load or a switch too
    update_successful, grad_norm, _ = optimizer.step()
    if update_successful and grad_norm is not None and not math.isfinite(float(grad_norm)):
        raise NonFiniteError(f"the gradient norm is {float(grad_norm)} (loss {loss:.6g})")
    if update_successful:  # as Megatron-LM: a skipped (overflowing fp16) step does not advance the LR
        scheduler.step(increment=lr_increment)
    scale_lr(optimizer, scheduler, next_lr_factor)
    return StepResult(
        lm_loss=loss,
        tokens=tokens,
        grad_norm=float(grad_norm) if grad_norm is not None else None,
        update_successful=bool(update_successful),
        loss_scale=loss_scale,
    )


@torch.no_grad()
def eval_step(model_chunks, data_iterators, *, num_microbatches: int, seq_length: int, micro_batch_size: int,
              pipeline_schedule=None) -> StepResult:
    """Forward-only loss over ``num_microbatches`` micro-batches per DP rank (``pipeline_schedule``:
    as :func:`train_step`)."""
    for chunk in model_chunks:
        chunk.eval()
    try:
        losses = _run_schedule(model_chunks, data_iterators, num_microbatches, seq_length, micro_batch_size, True, pipeline_schedule)
    finally:
        for chunk in model_chunks:
            chunk.train()
    loss, tokens = _loss_and_tokens(_host_values(_loss_totals(losses)))
    return StepResult(lm_loss=loss, tokens=tokens)
