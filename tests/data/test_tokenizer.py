"""SentencePiece training, loading (incl. LLaMA-style models), caching and Megatron's interface."""

import io
import pickle
import shutil
import threading

import numpy
import pytest
import sentencepiece
import torch

from epas_megatron.data.tokenizer import (
    MIN_VOCAB_SIZE,
    default_tokenizer,
    default_tokenizer_path,
    evenly_spaced,
    load_tokenizer,
    train_sentencepiece,
)
from epas_megatron.errors import ConfigError

ROUND_TRIP_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand    runs of spaces",
    "def f(x):\n    return x ** 2  # comment\n",
    "Unicode: naïve café, Ελληνικά, 漢字, emoji 😀, math ∑∫",
    "",
    "\n",
    "1234567890 3.14159",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_decode_of_encode_is_identity(tokenizer, text):
    ids = tokenizer.tokenize(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.detokenize(ids) == text


def test_round_trip_on_corpus_documents(tokenizer, small_documents):
    for document in small_documents:
        assert tokenizer.detokenize(tokenizer.tokenize(document)) == document


def test_special_ids_and_megatron_interface(tokenizer):
    assert tokenizer.vocab_size == 512
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.pad) == (0, 1, 2, 3)
    assert tokenizer.eod == tokenizer.eos == 2
    assert tokenizer.piece(1) == "<s>" and tokenizer.piece(2) == "</s>"
    assert tokenizer.vocab["</s>"] == 2 and tokenizer.inv_vocab[2] == "</s>"
    assert tokenizer.unique_identifiers["vocab_size"] == 512
    # tokenize adds no BOS/EOS; EOD is appended by preprocessing.
    ids = tokenizer.tokenize("hello world")
    assert tokenizer.bos not in ids and tokenizer.eos not in ids
    # the encoder learned merges: far fewer tokens than UTF-8 bytes on English text
    text = "the function returns the value of the attribute"
    assert len(tokenizer.tokenize(text)) < len(text.encode()) / 2


def test_detokenize_accepts_arrays_and_tensors(tokenizer):
    ids = tokenizer.tokenize("arrays and tensors")
    assert tokenizer.detokenize(numpy.array(ids, dtype=numpy.uint16)) == "arrays and tensors"
    assert tokenizer.detokenize(torch.tensor(ids)) == "arrays and tensors"


def test_pickle_carries_the_model(tokenizer, tmp_path, tokenizer_model):
    moved = tmp_path / "moved.model"
    shutil.copy(tokenizer_model, moved)
    restored = pickle.loads(pickle.dumps(load_tokenizer(moved)))
    moved.unlink()  # the copy needs no file
    assert restored.tokenize("pickled text") == tokenizer.tokenize("pickled text")
    # the cache identity follows the content, not the path
    assert restored.unique_identifiers == tokenizer.unique_identifiers


def test_training_is_deterministic(tmp_path, small_corpus, tokenizer_model):
    again = train_sentencepiece([small_corpus], tmp_path / "again", 512)
    assert again.read_bytes() == tokenizer_model.read_bytes()
    vocab_lines = (tmp_path / "again.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 512 and vocab_lines[2].startswith("</s>\t")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.model", "again.vocab"]


def test_training_from_txt_and_subsampling(tmp_path, small_documents):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(small_documents), encoding="utf-8")
    full = train_sentencepiece([path], tmp_path / "full", 400)
    sampled = train_sentencepiece([path], tmp_path / "sampled", 400, max_sentences=50)
    assert load_tokenizer(full).vocab_size == 400
    assert full.read_bytes() != sampled.read_bytes()


def test_evenly_spaced_keeps_exactly_k_spread_items():
    kept = [i for i, keep in enumerate(evenly_spaced(10, 3)) if keep]
    assert kept == [3, 6, 9]
    assert all(evenly_spaced(4, 10))
    assert sum(evenly_spaced(1000, 7)) == 7


def _spm_model(tmp_path, name, **special) -> bytes:
    lines = ["the cat sat on the mat", "a dog and a cat", "hello world"] * 20
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=40,
        model_type="bpe", minloglevel=2, **special,
    )
    path = tmp_path / name
    path.write_bytes(model.getvalue())
    return path


def test_llama_style_model_without_pad(tmp_path):
    # LLaMA's tokenizer.model: unk=0, bos=1, eos=2 and no pad piece.
    path = _spm_model(tmp_path, "tokenizer.model", unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    tokenizer = load_tokenizer(path)
    assert (tokenizer.bos, tokenizer.eod, tokenizer.pad) == (1, 2, -1)
    assert tokenizer.detokenize(tokenizer.tokenize("the cat")) == "the cat"


def test_model_without_eos_is_rejected(tmp_path):
    path = _spm_model(tmp_path, "noeos.model", unk_id=0, bos_id=1, eos_id=-1)
    with pytest.raises(ConfigError, match="--tokenizer-model.*end-of-sentence"):
        load_tokenizer(path)


@pytest.mark.parametrize("content", [None, b"", b"definitely not a protobuf", b"\x00" * 64])
def test_bad_model_files_name_the_flag(tmp_path, content):
    path = tmp_path / "tokenizer.model"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        load_tokenizer(path)


def test_no_model_given():
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        load_tokenizer(None)


def test_vocab_size_too_small_or_too_large(tmp_path, small_corpus):
    with pytest.raises(ConfigError, match="--vocab-size"):
        train_sentencepiece([small_corpus], tmp_path / "tiny", MIN_VOCAB_SIZE - 1)
    with pytest.raises(ConfigError, match="--vocab-size"):
        train_sentencepiece([small_corpus], tmp_path / "huge", 200_000)
    assert list(tmp_path.iterdir()) == []


def test_training_rejects_bad_inputs(tmp_path):
    with pytest.raises(ConfigError, match="--input"):
        train_sentencepiece([tmp_path / "missing.txt"], tmp_path / "m", 512)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n", encoding="utf-8")
    with pytest.raises(ConfigError, match="--input"):
        train_sentencepiece([blank], tmp_path / "m", 512)


def test_default_tokenizer_is_trained_once_and_cached(tmp_path):
    first = default_tokenizer_path(tmp_path, vocab_size=512, corpus_max_bytes=64 * 1024)
    mtime = first.stat().st_mtime_ns
    tokenizer = default_tokenizer(tmp_path, vocab_size=512, corpus_max_bytes=64 * 1024)
    assert tokenizer.path == str(first) and first.stat().st_mtime_ns == mtime
    assert "512" in first.name
    other = default_tokenizer_path(tmp_path, vocab_size=600, corpus_max_bytes=64 * 1024)
    assert other != first and load_tokenizer(other).vocab_size == 600


def test_default_tokenizer_races_are_safe(tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(default_tokenizer_path(tmp_path, 512, corpus_max_bytes=64 * 1024))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(results)) == 1
    assert load_tokenizer(results[0]).vocab_size == 512
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_ids_and_text_equal_megatron_cores_sentencepiece_tokenizer(tokenizer, tokenizer_model, small_documents):
    """Megatron-Core's wrapper over the same model is the reference for ids and text (with its
    whitespace handling switched to keep text as is, as this project's models are trained)."""
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer

    theirs = SentencePieceTokenizer(str(tokenizer_model), ignore_extra_whitespaces=False)
    for text in [*small_documents[:5], "plain words", "tabs\tand  double  spaces\n"]:
        ids = tokenizer.tokenize(text)
        assert ids == theirs.text_to_ids(text)
        assert tokenizer.detokenize(ids) == theirs.ids_to_text(ids)
    assert (tokenizer.eod, tokenizer.bos, tokenizer.pad) == (theirs.eos_id, theirs.bos_id, theirs.pad_id)
