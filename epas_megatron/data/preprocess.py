"""Tokenize ``.txt``/``.jsonl`` files into a Megatron indexed dataset (``epas-preprocess``).

    epas-preprocess --input corpus.jsonl --tokenizer-model tokenizer.model \\
        --output-prefix data/corpus [--json-key text] [--txt-documents paragraphs] [--workers 4]

Decisions:

- **Documents**: a ``.jsonl`` line's ``--json-key`` string is one document; a ``.txt`` file is cut
  into documents at blank lines (``--txt-documents paragraphs``, the default) or is one document
  (``--txt-documents files``). Directories are expanded to their ``.txt``/``.jsonl`` files in
  sorted order. Blank documents are skipped.
- **EOD**: every document is stored as its token ids followed by the tokenizer's EOD id, as one
  sequence of the indexed dataset; no BOS is added.
- **Determinism**: documents keep input order whatever ``--workers`` is (workers tokenize
  batches that are reassembled in order), so the output bytes do not depend on it.
- **Failure**: flags and inputs are checked before the tokenizer runs (each error names its
  flag; exit status 2); output is written under temporary names and renamed at the end
  (:class:`.indexed.IndexedDatasetWriter`), so an interrupted run leaves no half dataset.
- **Progress**: documents/s and MB/s of input text on stderr every ``--log-interval`` seconds,
  and a summary line at the end.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

from epas_megatron.data.corpus import TXT_DOCUMENT_MODES, check_input_files, iter_documents
from epas_megatron.data.indexed import IndexedDatasetWriter, IndexedStats, normalize_prefix
from epas_megatron.data.tokenizer import SentencePieceTokenizer, load_tokenizer
from epas_megatron.errors import ConfigError

__all__ = ["main", "preprocess"]

DOCUMENTS_PER_BATCH = 256
"""Documents handed to a worker at a time."""


class Progress:
    """Periodic throughput lines (documents/s, MB/s of input text) on a stream."""

    def __init__(self, stream: TextIO, interval_s: float):
        self.stream = stream
        """Where lines go (stderr for the CLI)."""
        self.interval_s = interval_s
        """Seconds between lines."""
        self.documents = 0
        """Documents done."""
        self.text_bytes = 0
        """UTF-8 bytes of input text done."""
        self.start = time.monotonic()
        self._last = self.start

    def update(self, documents: int, text_bytes: int) -> None:
        """Count finished work; print a line when ``interval_s`` has passed since the last."""
        self.documents += documents
        self.text_bytes += text_bytes
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            print(f"preprocess: {self.line(now)}", file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        """``N documents, X MB in T s (D documents/s, R MB/s)``."""
        elapsed = max((now or time.monotonic()) - self.start, 1e-9)
        megabytes = self.text_bytes / 1e6
        return (
            f"{self.documents:,} documents, {megabytes:.1f} MB in {elapsed:.1f} s "
            f"({self.documents / elapsed:,.0f} documents/s, {megabytes / elapsed:.2f} MB/s)"
        )


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """Consecutive lists of ``size`` items (the last may be shorter)."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def with_eod(token_lists: Sequence[list[int]], eod: int) -> list[list[int]]:
    """Each document's ids followed by the end-of-document id."""
    return [ids + [eod] for ids in token_lists]


_WORKER_TOKENIZER: SentencePieceTokenizer | None = None


def _init_worker(tokenizer: SentencePieceTokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _tokenize_batch(batch: list[str]) -> tuple[list[list[int]], int]:
    ids = with_eod(_WORKER_TOKENIZER.tokenize_batch(batch), _WORKER_TOKENIZER.eod)
    return ids, sum(len(text.encode("utf-8")) for text in batch)


def _tokenized_batches(
    batches: Iterable[list[str]], tokenizer: SentencePieceTokenizer, workers: int
) -> Iterator[tuple[list[list[int]], int]]:
    """Tokenized batches in input order, in this process or in ``workers`` processes."""
    if workers == 1:
        _init_worker(tokenizer)
        yield from map(_tokenize_batch, batches)
        return
    # "spawn": workers import only this module's light dependencies, never a forked torch.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        yield from pool.imap(_tokenize_batch, batches, chunksize=1)


def check_preprocess_flags(output_prefix: str | Path, workers: int, log_interval: float) -> None:
    """Reject bad ``--output-prefix``, ``--workers`` and ``--log-interval`` values."""
    if workers < 1:
        raise ConfigError(f"--workers: must be at least 1, got {workers}")
    if log_interval <= 0:
        raise ConfigError(f"--log-interval: must be positive, got {log_interval}")
    prefix = Path(normalize_prefix(output_prefix))
    if prefix.name in ("", ".", ".."):
        raise ConfigError(f"--output-prefix: {output_prefix!r} names a directory, not a prefix")
    for parent in (prefix.parent, *prefix.parent.parents):
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--output-prefix: {parent} exists and is not a directory")
            break


def preprocess(
    inputs: Sequence[str | Path],
    output_prefix: str | Path,
    tokenizer: SentencePieceTokenizer,
    *,
    json_key: str = "text",
    txt_documents: str = "paragraphs",
    workers: int = 1,
    log_interval: float = 10.0,
    log_stream: TextIO | None = None,
) -> IndexedStats:
    """Tokenize ``inputs`` into ``<output_prefix>.bin``/``.idx``; return what was written.

    Raises ConfigError (naming the flag) for bad inputs, before any tokenization where the
    problem can be seen up front, and when the inputs hold no document at all.
    """
    log_stream = sys.stderr if log_stream is None else log_stream
    check_preprocess_flags(output_prefix, workers, log_interval)
    if txt_documents not in TXT_DOCUMENT_MODES:
        raise ConfigError(
            f"--txt-documents: {txt_documents!r} is not one of {', '.join(TXT_DOCUMENT_MODES)}"
        )
    files = check_input_files(inputs, json_key)
    prefix = normalize_prefix(output_prefix)
    batches = batched(iter_documents(files, json_key, txt_documents), DOCUMENTS_PER_BATCH)
    with IndexedDatasetWriter(prefix, tokenizer.vocab_size) as writer:
        progress = Progress(log_stream, log_interval)
        for token_lists, text_bytes in _tokenized_batches(batches, tokenizer, workers):
            for ids in token_lists:
                writer.add_document(ids)
            progress.update(len(token_lists), text_bytes)
        if writer.documents == 0:
            raise ConfigError(f"--input: {', '.join(map(str, files))} hold no non-blank document")
        stats = writer.stats()
    print(
        f"preprocess: wrote {prefix}.bin/.idx: {stats.documents:,} documents, "
        f"{stats.tokens:,} tokens ({writer.dtype.__name__}); {progress.line()}",
        file=log_stream,
        flush=True,
    )
    return stats


def build_parser() -> argparse.ArgumentParser:
    """The ``epas-preprocess`` command line."""
    parser = argparse.ArgumentParser(
        prog="epas-preprocess",
        description="Tokenize .txt/.jsonl files into a Megatron indexed dataset (.bin/.idx).",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help=".txt/.jsonl files or directories holding them")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer-model", required=True, metavar="PATH",
                        help="SentencePiece .model file (e.g. LLaMA's tokenizer.model)")
    parser.add_argument("--json-key", default="text",
                        help="field of each .jsonl record that holds the text (default: text)")
    parser.add_argument("--txt-documents", choices=TXT_DOCUMENT_MODES, default="paragraphs",
                        help="a .txt document is a blank-line separated block, or the whole file")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizer processes; output is identical for any value")
    parser.add_argument("--log-interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``epas-preprocess``; returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        check_preprocess_flags(args.output_prefix, args.workers, args.log_interval)
        check_input_files(args.input, args.json_key)
        tokenizer = load_tokenizer(args.tokenizer_model)
        preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            json_key=args.json_key,
            txt_documents=args.txt_documents,
            workers=args.workers,
            log_interval=args.log_interval,
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
