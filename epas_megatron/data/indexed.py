"""Megatron indexed datasets (``<prefix>.bin`` + ``<prefix>.idx``): writing and cheap inspection.

Decisions:

- **Writing goes through Megatron-Core's** ``IndexedDatasetBuilder``, so the files are exactly
  what ``IndexedDataset``/``GPTDataset`` read. One document is one sequence (no sentence split);
  the caller passes the document's ids *including* its trailing EOD.
- **Token dtype** follows Megatron: ``uint16`` when the vocabulary has fewer than 65500 ids,
  else ``int32`` (:func:`token_dtype`). Ids outside ``[0, vocab_size)`` are rejected rather than
  silently wrapped.
- **Atomic output.** Both files are written under temporary names in the output directory and
  renamed only after the index is complete: the old ``.idx`` is removed first, then ``.bin`` and
  ``.idx`` are renamed in that order, so a crash at any point leaves the old dataset, no dataset
  (no ``.idx``), or the new one, never a ``.bin`` paired with a foreign ``.idx``. A failure inside
  the ``with`` block removes the temporary files.
- **Inspection without Megatron.** :func:`read_sequence_lengths` parses the ``.idx`` header with
  NumPy alone (importing Megatron-Core takes seconds), so flag checks can run before heavy work,
  and it cross-checks the ``.bin`` size so a truncated dataset is reported, not trained on.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy

from epas_megatron.errors import ConfigError
from epas_megatron.runtime.fs import AtomicFiles

__all__ = [
    "IndexedDatasetWriter",
    "IndexedStats",
    "bin_path",
    "idx_path",
    "indexed_fingerprint",
    "normalize_prefix",
    "read_sequence_lengths",
    "token_dtype",
]

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""Magic bytes at the start of every Megatron ``.idx`` file."""

INDEX_DTYPES = {
    1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32,
    5: numpy.int64, 6: numpy.float64, 7: numpy.float32, 8: numpy.uint16,
}
"""Megatron's ``DType`` codes (``megatron/core/datasets/indexed_dataset.py``)."""

UINT16_VOCAB_LIMIT = 65500
"""Vocabularies smaller than this are stored as ``uint16`` (Megatron's ``DType.optimal_dtype``)."""


def token_dtype(vocab_size: int) -> type[numpy.number]:
    """The ``.bin`` element type for a vocabulary: ``uint16`` below 65500 ids, else ``int32``."""
    return numpy.uint16 if vocab_size < UINT16_VOCAB_LIMIT else numpy.int32


def normalize_prefix(path: str | Path) -> str:
    """A dataset prefix from a prefix or either file's path (``data/x.bin`` -> ``data/x``)."""
    text = str(path)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return text[: -len(suffix)]
    return text


def bin_path(prefix: str | Path) -> Path:
    """``<prefix>.bin``."""
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    """``<prefix>.idx``."""
    return Path(f"{prefix}.idx")


@dataclass(frozen=True)
class IndexedStats:
    """What an indexed dataset holds."""

    documents: int
    """Number of documents (one sequence each when written here)."""

    tokens: int
    """Number of tokens, EODs included."""


def read_sequence_lengths(prefix: str | Path, flag: str = "--data") -> numpy.ndarray:
    """Token count of every sequence of an indexed dataset (int32), read with NumPy only.

    Raises ConfigError naming ``flag`` when a file is missing, the ``.idx`` is not a Megatron
    index, or the ``.bin`` size disagrees with the index.
    """
    index, data = idx_path(prefix), bin_path(prefix)
    for path in (index, data):
        if not path.is_file():
            raise ConfigError(
                f"{flag}: {path} does not exist; a dataset prefix needs both {prefix}.bin and "
                f"{prefix}.idx (make them with epas-preprocess)"
            )
    with open(index, "rb") as stream:
        header = stream.read(9 + 8 + 1 + 8 + 8)
        if len(header) < 34 or header[:9] != INDEX_HEADER:
            raise ConfigError(f"{flag}: {index} is not a Megatron indexed-dataset index")
        version, code, sequences, _documents = struct.unpack("<QBQQ", header[9:])
        if version != 1 or code not in INDEX_DTYPES:
            raise ConfigError(f"{flag}: {index} has an unknown version or dtype code")
        lengths = numpy.fromfile(stream, dtype=numpy.int32, count=sequences)
    if lengths.shape[0] != sequences:
        raise ConfigError(f"{flag}: {index} is truncated")
    expected = int(lengths.sum(dtype=numpy.int64)) * numpy.dtype(INDEX_DTYPES[code]).itemsize
    if data.stat().st_size != expected:
        raise ConfigError(
            f"{flag}: {data} holds {data.stat().st_size} bytes but its index describes {expected}; "
            "the dataset is truncated or its files come from different runs: preprocess it again"
        )
    return lengths


def indexed_fingerprint(prefixes: Sequence[str | Path]) -> str:
    """Hex digest of the ``.idx`` bytes and ``.bin`` sizes: changes when a dataset is rewritten."""
    digest = hashlib.sha256()
    for prefix in prefixes:
        digest.update(str(bin_path(prefix).stat().st_size).encode())
        with open(idx_path(prefix), "rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


class IndexedDatasetWriter:
    """Write token documents to ``<prefix>.bin``/``.idx`` atomically (see module doc).

    Use as a context manager; files appear under their final names only when the block exits
    without an exception.
    """

    def __init__(self, prefix: str | Path, vocab_size: int):
        self.prefix = normalize_prefix(prefix)
        """Final dataset prefix."""
        self.vocab_size = vocab_size
        """Ids must lie in ``[0, vocab_size)``; also picks the dtype."""
        self.dtype = token_dtype(vocab_size)
        """Element type of the ``.bin`` file."""
        self.documents = 0
        """Documents written so far."""
        self.tokens = 0
        """Tokens written so far."""
        self._files = None
        self._builder = None

    def __enter__(self) -> "IndexedDatasetWriter":
        with warnings.catch_warnings():  # Megatron-Core warns about absent GPU libraries
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        # The .idx goes last: it is removed before the .bin is replaced and renamed after it.
        self._files = AtomicFiles(bin_path(self.prefix), idx_path(self.prefix))
        try:
            self._builder = IndexedDatasetBuilder(str(self._files.temp_paths[0]), dtype=self.dtype)
        except BaseException:
            self._files.discard()
            raise
        return self

    def add_document(self, ids: Sequence[int]) -> None:
        """Append one document (its ids, EOD included) as one sequence."""
        array = numpy.asarray(ids, dtype=numpy.int64)
        if array.ndim != 1 or array.size == 0:
            raise ValueError("a document must be a non-empty 1-D sequence of token ids")
        if array.min() < 0 or array.max() >= self.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}); got [{array.min()}, {array.max()}]"
            )
        self._builder.add_document(array, [array.size])
        self.documents += 1
        self.tokens += int(array.size)

    def stats(self) -> IndexedStats:
        """Documents and tokens written so far."""
        return IndexedStats(documents=self.documents, tokens=self.tokens)

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is None:
                self._builder.finalize(str(self._files.temp_paths[1]))
                self._files.commit()
            else:
                self._builder.data_file.close()
        finally:
            self._files.discard()
