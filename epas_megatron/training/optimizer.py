"""Megatron DDP, optimizer and learning-rate schedule for a set of model chunks.

Built afresh whenever the model is (re)built -- at start, and at every EPAS switch -- so that
parameters frozen by a switch (the Q/K rows of sharing layers, ``requires_grad=False``) are in
no gradient buffer, no optimizer parameter group and no all-reduce: Megatron's DDP and
``get_megatron_optimizer`` both skip parameters that do not require gradients. No weight decay
is applied to 1-D parameters (norm weights), as in Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    bf16: bool
    """bf16 parameters with fp32 main parameters and gradients."""

    use_distributed_optimizer: bool
    """Shard optimizer state over data-parallel ranks (CUDA only)."""

    overlap_grad_reduce: bool
    """Overlap DP gradient reduction with backward."""

    warmup_iters: int
    """Linear warm-up iterations."""

    decay_iters: int
    """Iterations over which the LR decays to min_lr."""

    decay_style: str
    """'cosine', 'linear' or 'constant'."""


def wrap_ddp(model_chunks, tf_config, settings: OptimizerSettings) -> list[DistributedDataParallel]:
    """Megatron DDP around each chunk; also installs the schedule hooks into the TransformerConfig."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.bf16,
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


def build_optimizer(wrapped_chunks, settings: OptimizerSettings):
    """Megatron AdamW over the trainable parameters of the chunks."""
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        bf16=settings.bf16,
        params_dtype=torch.bfloat16 if settings.bf16 else torch.float32,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, list(wrapped_chunks))


def build_scheduler(optimizer, settings: OptimizerSettings) -> OptimizerParamScheduler:
    """Warm-up then decay, stepped once per iteration."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_iters,
        lr_decay_steps=max(settings.decay_iters, settings.warmup_iters + 1),
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(settings.decay_iters, 1),
        wd_incr_style="constant",
    )
