"""Shared, session-scoped data for the data-pipeline tests: built once, a few KB each.

A 128 KB slice of the default corpus (about 20 documents), a 512-piece tokenizer trained on it
and the indexed dataset preprocessed from both. Tests must not modify these files.
"""

import warnings
from pathlib import Path

import pytest

from epas_megatron.data.corpus import build_default_corpus, iter_documents
from epas_megatron.data.preprocess import preprocess
from epas_megatron.data.tokenizer import load_tokenizer, train_sentencepiece

SMALL_CORPUS_BYTES = 128 * 1024
SMALL_VOCAB = 512


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def small_corpus(data_dir) -> Path:
    return build_default_corpus(data_dir / "corpus.jsonl", max_bytes=SMALL_CORPUS_BYTES)


@pytest.fixture(scope="session")
def small_documents(small_corpus) -> list[str]:
    return list(iter_documents([small_corpus]))


@pytest.fixture(scope="session")
def tokenizer_model(data_dir, small_corpus) -> Path:
    return train_sentencepiece([small_corpus], data_dir / "tok512", SMALL_VOCAB)


@pytest.fixture(scope="session")
def tokenizer(tokenizer_model):
    return load_tokenizer(tokenizer_model)


@pytest.fixture(scope="session")
def indexed_prefix(data_dir, small_corpus, tokenizer) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preprocess([small_corpus], data_dir / "indexed" / "corpus", tokenizer, log_interval=60)
    return str(data_dir / "indexed" / "corpus")
