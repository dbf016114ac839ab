"""Preprocessing to Megatron indexed datasets: content read back, dtype, atomicity, CLI errors."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy
import pytest

from epas_megatron.data.indexed import (
    IndexedDatasetWriter,
    read_sequence_lengths,
    token_dtype,
)
from epas_megatron.data.preprocess import main, preprocess, with_eod
from epas_megatron.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def megatron_indexed(prefix):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    return IndexedDataset(str(prefix))


def expected_documents(tokenizer, texts):
    return [tokenizer.tokenize(text) + [tokenizer.eod] for text in texts]


def test_token_dtype_follows_megatron():
    from megatron.core.datasets.indexed_dataset import DType

    for vocab in (256, 32000, 65499, 65500, 128256):
        assert token_dtype(vocab) is DType.optimal_dtype(vocab)
    assert token_dtype(32000) is numpy.uint16 and token_dtype(128256) is numpy.int32


def test_with_eod():
    assert with_eod([[5, 6], []], 2) == [[5, 6, 2], [2]]


def test_indexed_dataset_reads_back_the_tokenized_documents(
    indexed_prefix, tokenizer, small_documents
):
    dataset = megatron_indexed(indexed_prefix)
    expected = expected_documents(tokenizer, small_documents)
    assert len(dataset) == len(expected)
    assert dataset.index.dtype is numpy.uint16
    for i, ids in enumerate(expected):
        assert dataset[i].tolist() == ids
    assert dataset.document_indices.tolist() == list(range(len(expected) + 1))
    assert read_sequence_lengths(indexed_prefix).tolist() == [len(ids) for ids in expected]


def test_txt_paragraphs_and_files_modes(tmp_path, tokenizer):
    text = tmp_path / "a.txt"
    text.write_text("One para.\n\nTwo\nlines.\n\n\n", encoding="utf-8")
    paragraphs = preprocess([text], tmp_path / "p", tokenizer, log_interval=60)
    files = preprocess([text], tmp_path / "f", tokenizer, txt_documents="files", log_interval=60)
    assert (paragraphs.documents, files.documents) == (2, 1)
    assert [d.tolist() for d in megatron_indexed(tmp_path / "p")] == expected_documents(
        tokenizer, ["One para.", "Two\nlines."]
    )
    assert [d.tolist() for d in megatron_indexed(tmp_path / "f")] == expected_documents(
        tokenizer, ["One para.\n\nTwo\nlines."]
    )


def test_output_is_identical_for_any_worker_count(
    tmp_path, small_corpus, tokenizer, indexed_prefix
):
    preprocess([small_corpus], tmp_path / "w2", tokenizer, workers=2, log_interval=60)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"w2{suffix}").read_bytes() == Path(indexed_prefix + suffix).read_bytes()


def test_progress_lines_report_rates(tmp_path, small_corpus, tokenizer, capsys):
    preprocess([small_corpus], tmp_path / "out", tokenizer, log_interval=1e-9)
    err = capsys.readouterr().err
    assert "documents/s" in err and "MB/s" in err and "wrote" in err


def test_failure_midway_leaves_old_dataset_and_no_temp_files(tmp_path, tokenizer):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    preprocess([good], tmp_path / "out", tokenizer, log_interval=60)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")}
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"document {i}"}) for i in range(600)] + [json.dumps({"x": 1})]
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="--json-key.*line 601"):
        preprocess([bad], tmp_path / "out", tokenizer, log_interval=60)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("out")}
    assert after == before and sorted(after) == ["out.bin", "out.idx"]


def test_no_documents_is_an_error_and_writes_nothing(tmp_path, tokenizer):
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": "   "}) + "\n")
    with pytest.raises(ConfigError, match="no non-blank document"):
        preprocess([blank], tmp_path / "out", tokenizer, log_interval=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl"]


def test_writer_rejects_ids_outside_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="token ids"):
        with IndexedDatasetWriter(tmp_path / "x", vocab_size=10) as writer:
            writer.add_document([1, 2, 10])
    assert list(tmp_path.iterdir()) == []


def test_int32_for_large_vocabularies(tmp_path):
    with IndexedDatasetWriter(tmp_path / "big", vocab_size=100_000) as writer:
        writer.add_document([99_999, 70_000, 5])
    dataset = megatron_indexed(tmp_path / "big")
    assert dataset.index.dtype is numpy.int32 and dataset[0].tolist() == [99_999, 70_000, 5]


def test_truncated_bin_is_reported(tmp_path, indexed_prefix):
    prefix = tmp_path / "copy"
    Path(f"{prefix}.idx").write_bytes(Path(indexed_prefix + ".idx").read_bytes())
    Path(f"{prefix}.bin").write_bytes(Path(indexed_prefix + ".bin").read_bytes()[:-2])
    with pytest.raises(ConfigError, match="--data.*truncated"):
        read_sequence_lengths(prefix)
    Path(f"{prefix}.idx").write_bytes(b"garbage" * 10)
    with pytest.raises(ConfigError, match="--data.*not a Megatron"):
        read_sequence_lengths(prefix)


def run_main(argv, capsys):
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err


def test_main_succeeds(tmp_path, small_corpus, tokenizer_model, capsys):
    status, err = run_main(
        ["--input", small_corpus, "--tokenizer-model", tokenizer_model,
         "--output-prefix", tmp_path / "cli", "--log-interval", "60"],
        capsys,
    )
    assert status == 0 and "wrote" in err
    assert (tmp_path / "cli.bin").is_file() and (tmp_path / "cli.idx").is_file()


@pytest.mark.parametrize(
    "case, flag",
    [
        ("missing_input", "--input"),
        ("empty_input", "--input"),
        ("unknown_extension", "--input"),
        ("missing_json_key", "--json-key"),
        ("bad_tokenizer", "--tokenizer-model"),
        ("missing_tokenizer", "--tokenizer-model"),
        ("bad_workers", "--workers"),
    ],
)
def test_main_bad_input_exits_2_naming_the_flag(tmp_path, tokenizer_model, capsys, case, flag):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "hello"}) + "\n")
    inputs, model, extra = good, tokenizer_model, []
    if case == "missing_input":
        inputs = tmp_path / "missing.jsonl"
    elif case == "empty_input":
        inputs = tmp_path / "empty.jsonl"
        inputs.write_text("")
    elif case == "unknown_extension":
        inputs = tmp_path / "data.parquet"
        inputs.write_text("x")
    elif case == "missing_json_key":
        extra = ["--json-key", "body"]
    elif case == "bad_tokenizer":
        model = tmp_path / "bad.model"
        model.write_bytes(b"not a model")
    elif case == "missing_tokenizer":
        model = tmp_path / "missing.model"
    elif case == "bad_workers":
        extra = ["--workers", "0"]
    argv = ["--input", inputs, "--tokenizer-model", model, "--output-prefix", tmp_path / "out"]
    status, err = run_main(argv + extra, capsys)
    assert status == 2
    assert err.startswith("error: ") and flag in err
    assert not list(tmp_path.glob("out*"))


def test_tools_wrapper_runs_main(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"),
         "--input", str(tmp_path / "nope.txt"), "--tokenizer-model", "x",
         "--output-prefix", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "error: --input" in result.stderr
