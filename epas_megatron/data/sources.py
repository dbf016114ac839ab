"""The data a run reads: dataset prefixes and tokenizer (the embedded default, or the user's)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from epas_megatron.data.default_data import default_cache_dir, prepare_default_data
from epas_megatron.data.tokenizer import SentencePieceTokenizer, load_tokenizer


@dataclass
class DataSources:
    """Resolved data sources."""

    prefixes: list[str]
    """Indexed dataset prefixes (or a weighted blend)."""

    tokenizer: SentencePieceTokenizer
    """The tokenizer the data was made with."""

    tokenizer_path: str
    """Its model file."""

    cache_dir: Path
    """Where dataset index caches (and the embedded corpus) live."""


def prepare_data_sources(data_cfg) -> DataSources:
    """Resolve ``DataConfig``; with no ``--data`` (or ``--data embedded``), build (once per node, under file locks) and use
    the embedded corpus. Collective when a process group exists."""
    cache_dir = Path(data_cfg.data_cache_dir) if data_cfg.data_cache_dir else default_cache_dir()
    if data_cfg.embedded:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            prepare_default_data(cache_dir, data_cfg.default_vocab_size)
        if dist.is_initialized():
            dist.barrier()
        prefix, default_tokenizer = prepare_default_data(cache_dir, data_cfg.default_vocab_size)
        prefixes, tokenizer_path = [prefix], data_cfg.tokenizer_model or default_tokenizer
    else:
        prefixes, tokenizer_path = list(data_cfg.data), data_cfg.tokenizer_model
    return DataSources(prefixes, load_tokenizer(tokenizer_path), str(tokenizer_path), cache_dir)
