"""The embedded default dataset: standard-library documentation -> tokenizer -> indexed dataset.

Everything is cached under the data cache directory and keyed by content (corpus hash, vocab
size), so the first run pays a few seconds and later runs reuse the files. Safe when several
processes race: the tokenizer and the indexed dataset are written under an exclusive lock with
atomic renames.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from epas_megatron.data.corpus import default_corpus_path, file_sha256
from epas_megatron.data.indexed import bin_path, idx_path
from epas_megatron.data.preprocess import preprocess
from epas_megatron.data.tokenizer import default_tokenizer_path, load_tokenizer
from epas_megatron.runtime.fs import exclusive_lock


def default_cache_dir() -> Path:
    """$EPAS_CACHE_DIR, else ~/.cache/epas_megatron."""
    return Path(os.environ.get("EPAS_CACHE_DIR", Path.home() / ".cache" / "epas_megatron"))


def prepare_default_data(cache_dir: str | os.PathLike, vocab_size: int) -> tuple[str, Path]:
    """(indexed dataset prefix, tokenizer model path) of the embedded corpus; built on first use."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_path = default_tokenizer_path(cache_dir, vocab_size)
    corpus = default_corpus_path(cache_dir)
    key = f"{file_sha256(corpus)[:12]}-{file_sha256(tokenizer_path)[:12]}"
    prefix = cache_dir / f"stdlib-docs-{vocab_size}-{key}"
    if not (bin_path(prefix).is_file() and idx_path(prefix).is_file()):
        with exclusive_lock(prefix.with_name(prefix.name + ".lock")):
            if not (bin_path(prefix).is_file() and idx_path(prefix).is_file()):
                preprocess([corpus], prefix, load_tokenizer(tokenizer_path), log_stream=io.StringIO())
    return str(prefix), tokenizer_path
