"""What both benchmarks share: a trainable model on synthetic tokens, and A/B timing.

Timing on shared machines drifts by several percent between blocks (and the first block after
warm-up is often off), so variants are timed in alternating blocks after warm-up iterations and
each variant's throughput is the median over its blocks.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from epas_megatron.engine.optimizer import OptimizerSettings
from epas_megatron.engine.state import TrainingState, build_training_state
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.fusions import choose_backend
from epas_megatron.random_ltd.model import set_kept_tokens
from epas_megatron.random_ltd.option import RandomLTDSettings


@dataclass
class BenchConfig:
    """What a benchmark measures (both benchmarks)."""

    preset: str
    """Model preset."""

    region: int
    """Sharing layers of the EPAS variants (the deepest ones)."""

    iters: int
    """Timed iterations per variant (split into blocks)."""

    blocks: int
    """Alternating timed blocks per variant."""

    warmup: int
    """Untimed iterations per variant first."""

    seq_length: int
    """Sequence length."""

    micro_batch_size: int
    """Micro-batch size."""

    num_microbatches: int
    """Micro-batches per iteration."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    vpp: Optional[int] = None
    """Virtual pipeline stages per rank."""

    share: str = "qk"
    """'qk' or 'kv'."""

    core_attention: str = "sdpa"
    """Attention kernel of local layers ('sdpa' or 'unfused')."""

    methods: tuple[str, ...] = ("epas",)
    """Variants timed against the baseline (``epas-bench train``): 'epas', 'random-ltd', 'both',
    'moc', 'epas-moc'."""

    kept_tokens: Optional[int] = None
    """Tokens Random-LTD layers keep (``random-ltd`` and ``both``); default half the sequence."""

    moc_topk: float = 0.2
    """Mixture-of-Channels kept fraction (``moc`` and ``epas-moc``; the paper's K)."""

    moc_groups: int = 8
    """Mixture-of-Channels channel groups."""

    seed: int = 1234
    """Initialisation seed (every variant gets the same weights)."""


BENCH_OPTIMIZER = dict(lr=1e-4, min_lr=1e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                       clip_grad=1.0, overlap_grad_reduce=False, warmup_iters=1, decay_iters=10**6, decay_style="constant")


class SyntheticTokens:
    """Endless micro-batches of random tokens; equal seeds give equal streams."""

    def __init__(self, vocab: int, seq: int, batch: int, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq, self.batch = vocab, seq, batch
        self.consumed = 0

    def __iter__(self):
        return self

    def __next__(self):
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.g)
        return {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(self.batch, self.seq),
            "position_ids": torch.arange(self.seq).expand(self.batch, -1),
            "sample_ids": self._next_ids(),
        }

    def _next_ids(self):
        ids = torch.arange(self.consumed, self.consumed + self.batch)
        self.consumed += self.batch
        return ids


@dataclass
class BenchVariant:
    """One model a benchmark times: its training state and its synthetic token streams."""

    state: TrainingState
    """Model, optimizer and LR schedule (:func:`~epas_megatron.engine.state.build_training_state`)."""

    data: list
    """One :class:`SyntheticTokens` stream per model chunk."""

    micro_batch_size: int
    """Sequences per micro-batch."""

    num_microbatches: int
    """Micro-batches per iteration."""


def bench_variant(plan: BuildPlan, *, micro_batch_size: int, num_microbatches: int, seed: int,
                  kept_tokens: Optional[int] = None) -> BenchVariant:
    """A trainable model of ``plan`` (a benchmark's: :func:`epas_megatron.assembly.plan_for_preset`),
    built from ``seed`` so every variant starts from the same weights, with the distributed
    optimizer on a GPU. Under Random-LTD (a :class:`~epas_megatron.random_ltd.option.RandomLTDSettings`
    option) its layers keep ``kept_tokens``."""
    settings = OptimizerSettings(precision=plan.precision, use_distributed_optimizer=torch.cuda.is_available(), **BENCH_OPTIMIZER)
    state = build_training_state(plan, settings, seed=seed)
    if plan.option(RandomLTDSettings) is not None:
        set_kept_tokens(state.model, kept_tokens)
    data = [SyntheticTokens(plan.arch.vocab_size, plan.seq_length, micro_batch_size, seed + 1) for _ in state.model]
    return BenchVariant(state, data, micro_batch_size, num_microbatches)


def default_backend() -> str:
    """Transformer Engine layers where TE is installed on a GPU node, local layers otherwise."""
    return choose_backend("auto", torch.cuda.is_available())


def run_iteration(variant: BenchVariant) -> None:
    """One training iteration of a :func:`bench_variant`."""
    from epas_megatron.engine.step import train_step

    state = variant.state
    train_step(state.model, state.optimizer, state.scheduler, variant.data,
               num_microbatches=variant.num_microbatches, seq_length=state.schedule_seq_length,
               micro_batch_size=variant.micro_batch_size)


def _sync() -> None:
    from epas_megatron.runtime.device import synchronize

    synchronize()
    if dist.is_initialized():
        dist.barrier()


def alternating_throughput(variants: dict, tokens_per_iteration: int, *, iters: int, blocks: int, warmup: int, log,
                           step=run_iteration) -> dict:
    """Tokens/s of each variant: tokens per iteration over the median of its per-block mean
    iteration times, the blocks alternating between the variants (after ``warmup`` iterations
    each). With an even number of blocks the median is the mean of the middle two times.
    ``step(variant)`` runs one iteration (a training step by default)."""
    for state in variants.values():
        for _ in range(warmup):
            step(state)
    per_block = max(1, iters // blocks)
    names = list(variants)
    times = {name: [] for name in names}
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            _sync()
            start = time.perf_counter()
            for _ in range(per_block):
                step(variants[name])
            _sync()
            times[name].append((time.perf_counter() - start) / per_block)
        log(f"  block {block + 1}/{blocks}: " + ", ".join(f"{n} {tokens_per_iteration / times[n][-1]:.1f} tok/s" for n in names))
    return {name: tokens_per_iteration / statistics.median(t) for name, t in times.items()}
