"""A run's data: sources (the embedded corpus or indexed datasets, and their tokenizer), the
train/validation splits, and one micro-batch iterator per model chunk and data-parallel rank.

Iterators are made per chunk because a chunk's pipeline position decides what it reads (the
first stage the tokens, the last the labels and loss mask, :func:`~epas_megatron.engine.step.stage_batch_keys`);
that position is the same in every layout a switch makes, so the training iterators are made
once, after the model is first built, and continue from the resumed sample count.
"""

from __future__ import annotations

from typing import Optional

from epas_megatron.data.datasets import build_data_iterator, build_gpt_datasets
from epas_megatron.data.sources import prepare_data_sources
from epas_megatron.errors import ConfigError
from epas_megatron.validation import ResolvedRun


class RunData:
    """Datasets and iterators of one run (``prepare`` on every rank before the model is built)."""

    def __init__(self, run: ResolvedRun):
        self.run = run
        self.sources = None
        """The prepared :class:`~epas_megatron.data.sources.DataSources` (tokenizer, prefixes)."""
        self.train_ds = None
        self.valid_ds = None
        self.train_iterators: list = []
        """One iterator of training micro-batches per model chunk."""
        self._dp: Optional[tuple[int, int]] = None  # (data-parallel rank, size)

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.sources.tokenizer_path

    def prepare(self) -> None:
        """Data sources (tokenizer trained or read; corpus built where missing) and the splits."""
        cfg, t = self.run.cfg, self.run.cfg.training
        self.sources = prepare_data_sources(cfg.data)
        tokenizer = self.sources.tokenizer
        if tokenizer.vocab_size > cfg.model.vocab_size:  # resolve_run sized it; a changed file could not be
            raise ConfigError(f"the tokenizer {self.sources.tokenizer_path} has {tokenizer.vocab_size} pieces, more than "
                              f"the model's vocabulary {cfg.model.vocab_size} resolved at start; was it replaced during start-up?")
        valid_samples = (t.eval_iters * t.global_batch_size) if t.eval_interval else 0
        self.train_ds, self.valid_ds = build_gpt_datasets(
            self.sources.prefixes,
            cfg.data.split,
            seq_length=t.seq_length,
            train_samples=max(t.train_iters * t.global_batch_size, t.global_batch_size),
            valid_samples=valid_samples,
            seed=t.seed,
            tokenizer=tokenizer,
            cache_dir=self.sources.cache_dir,
        )

    def start_training(self, model_chunks: list, dp_rank: int, dp_size: int, consumed_samples: int) -> None:
        """The training iterators of ``model_chunks``, from sample ``consumed_samples`` on."""
        from epas_megatron.engine.step import stage_batch_keys  # megatron-core (seconds; epas-plan needs none)

        self._dp = (dp_rank, dp_size)
        mbs = self.run.cfg.training.micro_batch_size
        self.train_iterators = [build_data_iterator(self.train_ds, mbs, dp_rank, dp_size, consumed_samples, keys=stage_batch_keys(chunk))
                                for chunk in model_chunks]

    def valid_iterators(self, model_chunks: list) -> list:
        """Fresh validation iterators (from the split's start) for ``model_chunks``."""
        from epas_megatron.engine.step import stage_batch_keys  # megatron-core (seconds; epas-plan needs none)

        dp_rank, dp_size = self._dp
        mbs = self.run.cfg.training.micro_batch_size
        return [build_data_iterator(self.valid_ds, mbs, dp_rank, dp_size, 0, keys=stage_batch_keys(chunk)) for chunk in model_chunks]
