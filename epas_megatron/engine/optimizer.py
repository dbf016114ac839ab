"""Megatron DDP, optimizer and learning-rate schedule for a set of model chunks.

Built afresh whenever the model is (re)built -- at start, and at every EPAS switch -- so that
parameters frozen by a switch (the Q/K rows of sharing layers, ``requires_grad=False``) are in
no gradient buffer, no optimizer parameter group and no all-reduce: Megatron's DDP and
``get_megatron_optimizer`` both skip parameters that do not require gradients. No weight decay
is applied to 1-D parameters (norm weights), as in Megatron-LM.

Precision: in bf16 and fp16 the model holds half-precision parameters and Megatron's optimizer
keeps fp32 main parameters (and, with the distributed optimizer, shards them over DP); gradients
are reduced in fp32. fp16 adds loss scaling -- dynamic by default (initial scale 2^15, see
``--initial-loss-scale``; halved after ``hysteresis`` overflowing steps, doubled after
``loss_scale_window`` clean ones), static with ``loss_scale``; an overflowing step skips the
update (``StepResult.update_successful``). The scaler's state is part of the optimizer's
checkpoint state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer needs from the run config."""

    lr: float
    """Peak learning rate."""

    min_lr: float
    """Final learning rate."""

    weight_decay: float
    """AdamW decoupled weight decay."""

    adam_beta1: float
    """beta1."""

    adam_beta2: float
    """beta2."""

    adam_eps: float
    """epsilon."""

    clip_grad: float
    """Global gradient-norm clip (0: off)."""

    use_distributed_optimizer: bool
    """Shard optimizer state (and fp32 main parameters) over data-parallel ranks."""

    overlap_grad_reduce: bool
    """Overlap DP gradient reduction with backward."""

    warmup_iters: int
    """Linear warm-up iterations."""

    decay_iters: int
    """Iterations over which the LR decays to min_lr."""

    decay_style: str
    """'cosine', 'linear' or 'constant'."""

    lr_schedule_units: Optional[tuple[int, int]] = None
    """(warm-up, decay) lengths in the units the LR schedule is stepped in, when those are not
    iterations (Random-LTD's LayerToken LR: layer tokens); None: ``warmup_iters``/``decay_iters``."""

    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16' (half-precision parameters with fp32 main parameters)."""

    loss_scale: Optional[float] = None
    """fp16: static loss scale; None for dynamic loss scaling."""

    initial_loss_scale: float = 2.0**15
    """fp16, dynamic: the first loss scale."""

    min_loss_scale: float = 1.0
    """fp16, dynamic: the scale never drops below this."""

    loss_scale_window: int = 1000
    """fp16, dynamic: clean steps before the scale doubles."""

    hysteresis: int = 2
    """fp16, dynamic: overflowing steps tolerated before the scale halves."""

    @property
    def half(self) -> bool:
        """bf16 or fp16 parameters."""
        return self.precision in ("bf16", "fp16")


def wrap_ddp(model_chunks, tf_config, settings: OptimizerSettings) -> list[DistributedDataParallel]:
    """Megatron DDP around each chunk; also installs the schedule hooks into the TransformerConfig."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.half,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = [
        DistributedDataParallel(tf_config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(model_chunks)
    ]
    no_sync = [w.no_sync for w in wrapped]
    tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if settings.overlap_grad_reduce:
        sync = [w.start_grad_sync for w in wrapped]
        tf_config.grad_sync_func = sync[0] if len(sync) == 1 else sync
    else:
        tf_config.grad_sync_func = None
    tf_config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(wrapped_chunks, settings: OptimizerSettings, tf_config=None):
    """Megatron AdamW over the trainable parameters of the chunks.

    With ``tf_config``, installs the optimizer's loss scaling as the schedules' ``grad_scale_func``
    (what Megatron-LM does; required for fp16, a multiplication by one otherwise)."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=settings.precision == "bf16",
        fp16=settings.precision == "fp16",
        params_dtype=dtypes[settings.precision],
        loss_scale=settings.loss_scale,
        initial_loss_scale=settings.initial_loss_scale,
        min_loss_scale=settings.min_loss_scale,
        loss_scale_window=settings.loss_scale_window,
        hysteresis=settings.hysteresis,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, list(wrapped_chunks))
    if tf_config is not None:
        tf_config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(optimizer, settings: OptimizerSettings) -> OptimizerParamScheduler:
    """Warm-up then decay, stepped once per iteration (by the iteration's layer tokens with
    ``lr_schedule_units``)."""
    warmup, decay = settings.lr_schedule_units or (settings.warmup_iters, settings.decay_iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1),
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(settings.decay_iters, 1),
        wd_incr_style="constant",
    )
