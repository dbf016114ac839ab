"""Data pipeline: default corpus, SentencePiece tokenizer, indexed datasets, GPT datasets, batches.

Text flows one way: documents (:mod:`.corpus`) -> token ids (:mod:`.tokenizer`) -> ``.bin``/
``.idx`` files (:mod:`.preprocess`, :mod:`.indexed`) -> Megatron-Core ``GPTDataset`` splits and
the resumable micro-batch iterator (:mod:`.datasets`). Each module's docstring records its
decisions (document format, EOD handling, determinism).

Layering: beside config at the bottom (config -> model/sharing -> parallel/checkpointing ->
training -> entry points): it imports only the runtime and Megatron-Core's dataset classes;
training, evaluation and inference (the tokenizer) read from it, ``epas-preprocess`` is its CLI.

Names are exported lazily (PEP 562): ``import epas_megatron.data.preprocess`` (the CLI, and its
spawned tokenizer workers) then loads neither torch nor Megatron-Core until they are needed, and
``python -m epas_megatron.data.preprocess`` does not import its own module twice.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DEFAULT_CORPUS_MAX_BYTES": "corpus",
    "build_default_corpus": "corpus",
    "check_input_files": "corpus",
    "default_corpus_path": "corpus",
    "iter_documents": "corpus",
    "stdlib_documents": "corpus",
    "write_jsonl": "corpus",
    "DEFAULT_VOCAB_SIZE": "tokenizer",
    "SentencePieceTokenizer": "tokenizer",
    "default_tokenizer": "tokenizer",
    "default_tokenizer_path": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_sentencepiece": "tokenizer",
    "IndexedDatasetWriter": "indexed",
    "IndexedStats": "indexed",
    "read_sequence_lengths": "indexed",
    "token_dtype": "indexed",
    "preprocess": "preprocess",
    "Blend": "datasets",
    "DataExhaustedError": "datasets",
    "MicroBatchIterator": "datasets",
    "build_data_iterator": "datasets",
    "build_gpt_datasets": "datasets",
    "collate_samples": "datasets",
    "micro_batch_indices": "datasets",
    "parse_blend": "datasets",
    "parse_split": "datasets",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; the runtime path is __getattr__
    from epas_megatron.data.corpus import (  # noqa: F401
        DEFAULT_CORPUS_MAX_BYTES,
        build_default_corpus,
        check_input_files,
        default_corpus_path,
        iter_documents,
        stdlib_documents,
        write_jsonl,
    )
    from epas_megatron.data.datasets import (  # noqa: F401
        Blend,
        DataExhaustedError,
        MicroBatchIterator,
        build_data_iterator,
        build_gpt_datasets,
        collate_samples,
        micro_batch_indices,
        parse_blend,
        parse_split,
    )
    from epas_megatron.data.indexed import (  # noqa: F401
        IndexedDatasetWriter,
        IndexedStats,
        read_sequence_lengths,
        token_dtype,
    )
    from epas_megatron.data.preprocess import preprocess  # noqa: F401
    from epas_megatron.data.tokenizer import (  # noqa: F401
        DEFAULT_VOCAB_SIZE,
        SentencePieceTokenizer,
        default_tokenizer,
        default_tokenizer_path,
        load_tokenizer,
        train_sentencepiece,
    )
