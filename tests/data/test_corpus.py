"""The default corpus (stdlib docstrings) and reading documents from .txt/.jsonl."""

import builtins
import json
import sys

import pytest

from epas_megatron.data import corpus
from epas_megatron.data.corpus import (
    build_default_corpus,
    check_input_files,
    default_corpus_path,
    drop_doctest_blocks,
    iter_documents,
    split_paragraphs,
    stdlib_documents,
    truncate_utf8,
)
from epas_megatron.errors import ConfigError


def read_texts(path):
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def test_small_corpus_respects_cap_and_is_prose(small_corpus):
    texts = read_texts(small_corpus)
    total = sum(len(t.encode("utf-8")) for t in texts)
    assert 0.9 * 128 * 1024 < total <= 128 * 1024
    assert len(texts) >= 10
    assert all(len(t) >= corpus.MIN_DOCSTRING_CHARS for t in texts)
    assert not any(line.lstrip().startswith(">>>") for t in texts for line in t.splitlines())
    # English prose: mostly letters and spaces, and common English words.
    joined = " ".join(texts)
    assert sum(c.isalpha() or c.isspace() for c in joined) / len(joined) > 0.8
    assert joined.count(" the ") > 100


def test_build_is_deterministic_and_atomic(tmp_path, small_corpus):
    again = build_default_corpus(tmp_path / "again.jsonl", max_bytes=128 * 1024)
    assert again.read_bytes() == small_corpus.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["again.jsonl"]  # no temp file left


def test_build_imports_no_module(monkeypatch, tmp_path):
    imported = []
    real_import = builtins.__import__

    def recording_import(name, *args, **kwargs):
        if name not in sys.modules:  # a module being loaded, not a lookup of a loaded one
            imported.append(name)
        return real_import(name, *args, **kwargs)

    before = set(sys.modules)
    monkeypatch.setattr(builtins, "__import__", recording_import)
    build_default_corpus(tmp_path / "c.jsonl", max_bytes=256 * 1024)
    monkeypatch.undo()
    assert imported == []
    assert set(sys.modules) == before
    assert "antigravity" not in sys.modules


def test_full_default_corpus_is_a_few_megabytes():
    documents = stdlib_documents()
    total = sum(len(d.encode("utf-8")) for d in documents)
    assert 1_000_000 < total <= corpus.DEFAULT_CORPUS_MAX_BYTES
    assert len(documents) > 200
    assert len(set(documents)) == len(documents)


def test_cap_truncates_the_crossing_document_at_a_line_break():
    documents = stdlib_documents(max_bytes=10_000)
    total = sum(len(d.encode("utf-8")) for d in documents)
    assert 9_000 < total <= 10_000
    assert documents == stdlib_documents(max_bytes=10_000)
    longer = stdlib_documents(max_bytes=20_000)
    assert documents[:-1] == longer[: len(documents) - 1]  # a larger cap only appends


def test_default_corpus_path_caches_per_python_and_cap(tmp_path):
    path = default_corpus_path(tmp_path, max_bytes=20_000)
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in path.name
    assert "20000" in path.name
    mtime = path.stat().st_mtime_ns
    assert default_corpus_path(tmp_path, max_bytes=20_000) == path
    assert path.stat().st_mtime_ns == mtime  # not rebuilt
    assert default_corpus_path(tmp_path, max_bytes=30_000) != path


def test_bad_cap_is_rejected():
    with pytest.raises(ConfigError):
        stdlib_documents(max_bytes=0)


def test_drop_doctest_blocks():
    text = "Intro line.\n\n>>> f(1)\n2\n>>> f(2)\n3\n\nAfter the example."
    assert drop_doctest_blocks(text) == "Intro line.\n\n\nAfter the example."


def test_truncate_utf8_respects_characters_and_lines():
    text = "first line\nsecond é line\nthird"
    assert truncate_utf8(text, 1000) == text
    assert truncate_utf8(text, len("first line\nsecond é")) == "first line"
    assert truncate_utf8("no break at all", 5) == ""
    cut = truncate_utf8("ab\néé\nc", 6)  # 'é' is 2 bytes: "ab\né" + half a character
    assert cut == "ab"


def test_split_paragraphs():
    text = "a\nb\n\n\n  \nc\n\nd  \n"
    assert split_paragraphs(text) == ["a\nb", "c", "d"]


def test_txt_documents_by_paragraph_and_by_file(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First para\nstill first.\n\nSecond para.\n\n\nThird.\n", encoding="utf-8")
    assert list(iter_documents([path])) == ["First para\nstill first.", "Second para.", "Third."]
    assert list(iter_documents([path], txt_documents="files")) == [
        "First para\nstill first.\n\nSecond para.\n\n\nThird."
    ]


def test_jsonl_documents_and_directories(tmp_path):
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"content": "two"}) + "\n\n" + json.dumps({"content": "  "}) + "\n",
        encoding="utf-8",
    )
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "one"}) + "\n", encoding="utf-8")
    (tmp_path / "ignored.csv").write_text("x", encoding="utf-8")
    assert list(iter_documents([tmp_path], json_key="content")) == ["one", "two"]


@pytest.mark.parametrize(
    "name, content, flag",
    [
        ("missing.jsonl", None, "--input"),
        ("empty.jsonl", "", "--input"),
        ("data.csv", "a,b\n", "--input"),
        ("nokey.jsonl", json.dumps({"body": "x"}) + "\n", "--json-key"),
        ("notjson.jsonl", "{not json\n", "--input"),
        ("number.jsonl", json.dumps({"text": 3}) + "\n", "--json-key"),
    ],
)
def test_bad_inputs_name_the_flag(tmp_path, name, content, flag):
    path = tmp_path / name
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=flag):
        check_input_files([path])


def test_missing_key_later_in_file_is_reported_with_line(tmp_path):
    path = tmp_path / "late.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"other": "x"}) + "\n")
    check_input_files([path])  # only the first record is checked up front
    with pytest.raises(ConfigError, match="line 2"):
        list(iter_documents([path]))


def test_no_inputs_is_rejected():
    with pytest.raises(ConfigError, match="--input"):
        check_input_files([])


def test_a_stdlib_without_sources_is_reported(tmp_path):
    (tmp_path / "only_data.txt").write_text("no python here")
    with pytest.raises(ConfigError, match="no default corpus"):
        stdlib_documents(root=tmp_path)
