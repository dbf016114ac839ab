"""SentencePiece tokenizer: training, loading, and the object Megatron-Core's datasets read.

Decisions:

- **Duck-typed for Megatron-Core.** ``GPTDatasetConfig.tokenizer`` is annotated as
  ``MegatronTokenizerBase`` but never type-checked; ``GPTDataset``/``MegatronDataset`` read
  ``vocab_size``, ``eod``, ``pad``, ``eos`` and ``unique_identifiers`` (the latter is hashed into
  the index-cache key). :class:`SentencePieceTokenizer` provides those (and ``tokenize``,
  ``detokenize``, ``vocab``, like Megatron's own tokenizers) without subclassing, so importing
  this module does not import Megatron-Core (~5 s) and CLIs can reject bad flags at once.
- **Special ids.** ``eod`` is the model's end-of-sentence id (LLaMA-style models: unk=0, bos=1,
  eos=2). ``pad`` is the model's pad id, or -1 when it has none (LLaMA), which is Megatron's own
  "no pad token" sentinel. Models trained here have unk=0, bos=1, eos=2, pad=3. ``tokenize``
  adds neither BOS nor EOS: documents are separated by the EOD that preprocessing appends.
- **Lossless text.** Models trained here use the ``identity`` normalizer, keep repeated
  whitespace and fall back to UTF-8 bytes for unseen characters (newlines and tabs included), so
  ``detokenize(tokenize(text)) == text`` for any text.
- **Deterministic training.** BPE, one thread (SentencePiece gives different merges with more
  threads), no shuffling. Sentences are the non-blank lines of the documents; above
  ``max_sentences`` an evenly spaced subset is kept (a deterministic stride, not a random sample).
  The model is written from memory (``model_writer``), so it records no paths and identical
  inputs give byte-identical ``.model`` files. Files are written under temporary names and renamed.
- **Default tokenizer.** Trained once on the default corpus (:mod:`.corpus`) and cached under a
  name that holds the vocabulary size and a hash of the corpus's bytes. A file lock keeps racing
  processes from training twice; the atomic rename keeps them correct even where locks do not
  work (some network filesystems). A cached model is reused as is, also after a SentencePiece
  upgrade, so resumed runs keep their tokenizer.
- **Not Megatron-Core's wrapper.** ``megatron.core.tokenizers``' ``SentencePieceTokenizer`` loads
  a model; this module also trains one (the default corpus has no tokenizer), keeps the text
  lossless by default (theirs drops repeated whitespace unless told not to), is picklable for
  data workers and names the bad flag on a bad file. Ids and text are the same as theirs over
  the same model (tested).
"""

from __future__ import annotations

import hashlib
import io
import numbers
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece

from epas_megatron.data.corpus import (
    DEFAULT_CORPUS_MAX_BYTES,
    check_input_files,
    default_corpus_path,
    file_sha256,
    iter_documents,
)
from epas_megatron.errors import ConfigError
from epas_megatron.runtime.fs import atomic_write_bytes, exclusive_lock

__all__ = [
    "SentencePieceTokenizer",
    "default_tokenizer",
    "load_tokenizer",
    "train_sentencepiece",
]

DEFAULT_VOCAB_SIZE = 8192
"""Vocabulary size of the default tokenizer."""

DEFAULT_MAX_SENTENCES = 5_000_000
"""Training sentences (lines) kept at most; more are subsampled with an even stride."""

TOKENIZER_FORMAT_VERSION = 1
"""Bumped whenever training options change, so older cached default tokenizers are not reused."""

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}
"""Special-token ids of models trained here (LLaMA layout plus a pad token)."""

BYTE_PIECES = 256
"""Pieces reserved by byte fallback."""

MIN_VOCAB_SIZE = BYTE_PIECES + len(SPECIAL_IDS) + 1
"""Smallest vocabulary that can hold the byte pieces, the special tokens and one more piece."""


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` with the interface Megatron-Core's GPT datasets read."""

    def __init__(self, model_path: Path | str):
        self.path = str(model_path)
        """Path of the ``.model`` file this tokenizer was loaded from."""
        self._model_proto = Path(model_path).read_bytes()
        self._sha256 = hashlib.sha256(self._model_proto).hexdigest()
        self._processor = _processor_from_bytes(self._model_proto)

    # Pickling (data-loader / preprocessing workers) carries the model bytes, not the path.
    def __getstate__(self) -> dict:
        return {"path": self.path, "model_proto": self._model_proto, "sha256": self._sha256}

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]
        self._model_proto = state["model_proto"]
        self._sha256 = state["sha256"]
        self._processor = _processor_from_bytes(self._model_proto)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        """Number of pieces; token ids are in ``[0, vocab_size)``."""
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        """End-of-document id appended after every document: the model's EOS id."""
        return self._processor.eos_id()

    @property
    def eos(self) -> int:
        """End-of-sentence id (the same as :attr:`eod`)."""
        return self._processor.eos_id()

    @property
    def bos(self) -> int:
        """Beginning-of-sentence id, -1 when the model has none."""
        return self._processor.bos_id()

    @property
    def pad(self) -> int:
        """Padding id, -1 when the model has none (Megatron's "no pad token" value)."""
        return self._processor.pad_id()

    @property
    def unk(self) -> int:
        """Unknown-piece id."""
        return self._processor.unk_id()

    @property
    def vocab(self) -> dict[str, int]:
        """Piece -> id."""
        return {self._processor.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> piece."""
        return {i: self._processor.id_to_piece(i) for i in range(self.vocab_size)}

    @property
    def sha256(self) -> str:
        """Hex SHA-256 of the ``.model`` bytes: identifies the tokenizer whatever its path."""
        return self._sha256

    @property
    def unique_identifiers(self) -> OrderedDict:
        """What Megatron-Core hashes into its dataset index-cache key (content, not path)."""
        return OrderedDict(
            [
                ("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                ("model_sha256", self._sha256),
                ("vocab_size", self.vocab_size),
            ]
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS or EOS is added."""
        return self._processor.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of several texts (one call into SentencePiece)."""
        return self._processor.encode(list(texts), out_type=int)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids (lists, NumPy arrays and tensors accepted)."""
        return self._processor.decode([int(i) for i in ids])

    def piece(self, token_id: int) -> str:
        """The piece string of one id (e.g. ``'▁the'``, ``'<0x0A>'``)."""
        return self._processor.id_to_piece(int(token_id))

    def apply_chat_template(self, *args, **kwargs):
        """Not supported: pretraining has no chat format."""
        raise NotImplementedError("SentencePieceTokenizer has no chat template")


def _processor_from_bytes(model_proto: bytes) -> sentencepiece.SentencePieceProcessor:
    processor = sentencepiece.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model_proto)
    return processor


def load_tokenizer(path: Path | str | None) -> SentencePieceTokenizer:
    """Load a SentencePiece ``.model`` (e.g. LLaMA's ``tokenizer.model``).

    Raises ConfigError naming ``--tokenizer-model`` when the file is missing, empty, not a
    SentencePiece model, or has no end-of-sentence piece (needed as the end-of-document token).
    """
    if path is None or str(path) == "":
        raise ConfigError("--tokenizer-model: no tokenizer model given")
    model_path = Path(path)
    if not model_path.is_file():
        raise ConfigError(f"--tokenizer-model: {model_path} does not exist or is not a file")
    if model_path.stat().st_size == 0:
        raise ConfigError(f"--tokenizer-model: {model_path} is empty")
    try:
        tokenizer = SentencePieceTokenizer(model_path)
    except (RuntimeError, OSError, TypeError):
        raise ConfigError(
            f"--tokenizer-model: {model_path} is not a valid SentencePiece model (its bytes do "
            "not parse as a SentencePiece ModelProto); pass the tokenizer's .model file"
        ) from None
    if tokenizer.eod < 0:
        raise ConfigError(
            f"--tokenizer-model: {model_path} has no end-of-sentence piece; pretraining needs one "
            "as the end-of-document token (train it with eos_id set)"
        )
    return tokenizer


def check_vocab_size(vocab_size: int) -> None:
    """Reject a vocabulary that byte fallback and the special tokens cannot fit in."""
    if not isinstance(vocab_size, numbers.Integral) or vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"--vocab-size: {vocab_size} is too small; byte fallback needs {BYTE_PIECES} pieces "
            f"and {len(SPECIAL_IDS)} special tokens, so use at least {MIN_VOCAB_SIZE} "
            "(512 or more in practice)"
        )


def evenly_spaced(total: int, keep: int) -> Iterator[bool]:
    """For ``i`` in ``range(total)``: whether item ``i`` is among ``keep`` evenly spaced ones."""
    for i in range(total):
        yield keep >= total or (i * keep) // total != ((i + 1) * keep) // total


def training_sentences(documents: Iterable[str]) -> Iterator[str]:
    """The non-blank lines of the documents (SentencePiece's unit of training text)."""
    for document in documents:
        for line in document.splitlines():
            if line.strip():
                yield line


def _sentence_source(
    paths: Sequence[Path], json_key: str, txt_documents: str, max_sentences: int
) -> Iterator[str]:
    """Training sentences of the inputs, evenly subsampled to at most ``max_sentences``."""

    def read() -> Iterator[str]:
        return training_sentences(iter_documents(paths, json_key, txt_documents))

    total = sum(1 for _ in read())
    if total == 0:
        raise ConfigError("--input: the tokenizer training inputs hold no text")
    return (s for s, kept in zip(read(), evenly_spaced(total, max_sentences)) if kept)


def _trainer_options(vocab_size: int, character_coverage: float) -> dict:
    return dict(
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        num_threads=1,
        shuffle_input_sentence=False,
        input_sentence_size=0,
        max_sentence_length=16384,
        minloglevel=2,
        **SPECIAL_IDS,
    )


def _vocab_text(model_proto: bytes) -> str:
    """The ``.vocab`` companion file: ``piece<TAB>score`` per id, as SentencePiece writes it."""
    processor = _processor_from_bytes(model_proto)
    return "".join(
        f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n"
        for i in range(processor.get_piece_size())
    )


def train_sentencepiece(
    input_paths: Sequence[Path | str],
    model_prefix: Path | str,
    vocab_size: int,
    *,
    json_key: str = "text",
    txt_documents: str = "paragraphs",
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    character_coverage: float = 0.9999,
) -> Path:
    """Train a byte-fallback BPE model on ``.txt``/``.jsonl`` files; return ``<prefix>.model``.

    Also writes ``<prefix>.vocab``. Inputs are read as in :func:`.corpus.iter_documents`.
    Raises ConfigError for bad inputs (``--input``/``--json-key``) or a vocabulary size the data
    cannot support (``--vocab-size``).
    """
    check_vocab_size(vocab_size)
    if max_sentences <= 0:
        raise ConfigError(f"max_sentences must be positive, got {max_sentences}")
    files = check_input_files(input_paths, json_key)
    sentences = _sentence_source(files, json_key, txt_documents, max_sentences)
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_writer=model,
            **_trainer_options(vocab_size, character_coverage),
        )
    except RuntimeError as error:
        message = str(error).split("]")[-1].strip()
        raise ConfigError(
            f"--vocab-size: SentencePiece cannot train on these inputs: {message}"
        ) from None
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    model_path = prefix.with_name(prefix.name + ".model")
    vocab_text = _vocab_text(model.getvalue()).encode("utf-8")
    atomic_write_bytes(prefix.with_name(prefix.name + ".vocab"), vocab_text)
    atomic_write_bytes(model_path, model.getvalue())
    return model_path


def default_tokenizer_path(
    cache_dir: Path | str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus_max_bytes: int = DEFAULT_CORPUS_MAX_BYTES,
) -> Path:
    """Path of the default tokenizer's ``.model`` under ``cache_dir``, trained on first use."""
    check_vocab_size(vocab_size)
    cache_dir = Path(cache_dir)
    corpus = default_corpus_path(cache_dir, corpus_max_bytes)
    corpus_key = file_sha256(corpus)[:16]
    prefix = cache_dir / f"stdlib-bpe-v{TOKENIZER_FORMAT_VERSION}-{vocab_size}-{corpus_key}"
    model_path = prefix.with_name(prefix.name + ".model")
    if model_path.is_file():
        return model_path
    with exclusive_lock(prefix.with_name(prefix.name + ".lock")):
        if not model_path.is_file():
            train_sentencepiece([corpus], prefix, vocab_size)
    return model_path


def default_tokenizer(
    cache_dir: Path | str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus_max_bytes: int = DEFAULT_CORPUS_MAX_BYTES,
) -> SentencePieceTokenizer:
    """The tokenizer trained on the default corpus (cached in ``cache_dir``; see module doc)."""
    return load_tokenizer(default_tokenizer_path(cache_dir, vocab_size, corpus_max_bytes))
