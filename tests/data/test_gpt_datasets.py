"""Train/valid GPTDatasets through Megatron-Core: splits, packing, caching, distributed, errors."""

import json
import multiprocessing
import warnings

import numpy
import pytest
import torch

from epas_megatron.data.datasets import (
    Blend,
    build_gpt_datasets,
    parse_blend,
    parse_split,
    split_ranges,
)
from epas_megatron.data.preprocess import preprocess
from epas_megatron.errors import ConfigError

SEQ = 64
SPLIT = "6,4,0"

warnings.filterwarnings("ignore", category=UserWarning)


def build(prefixes, tokenizer, cache_dir, **overrides):
    arguments = dict(seq_length=SEQ, train_samples=1000, valid_samples=50, seed=1234,
                     tokenizer=tokenizer, cache_dir=cache_dir)
    arguments.update(overrides)
    split = arguments.pop("split", SPLIT)
    return build_gpt_datasets(prefixes, split, **arguments)


@pytest.fixture(scope="module")
def splits(indexed_prefix, tokenizer, tmp_path_factory):
    return build([indexed_prefix], tokenizer, tmp_path_factory.mktemp("cache"))


def document_tokens(tokenizer, documents):
    return [tokenizer.tokenize(d) + [tokenizer.eod] for d in documents]


def write_dataset(path, texts, tokenizer):
    source = path.with_suffix(".jsonl")
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess([source], path, tokenizer, log_interval=60)
    return str(path)


# --- flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "split", ["969,30,1", "8,2", "1", "99,1,0", "0.5,0.25,0.25", "1,1,1", "3,0,1"]
)
@pytest.mark.parametrize("num_sequences", [1, 5, 20, 33, 1001])
def test_split_ranges_match_megatron(split, num_sequences):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    expected = [
        None if bounds is None
        else (int(round(bounds[0] * num_sequences)), int(round(bounds[1] * num_sequences)))
        for bounds in matrix
    ]
    assert split_ranges(num_sequences, parse_split(split)) == expected


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "0,0,0", "-1,2", "1e3,1"])
def test_bad_split_names_the_flag(split):
    with pytest.raises(ConfigError, match="--split"):
        parse_split(split)


def test_parse_blend_forms():
    assert parse_blend(["a", "b.bin"]) == Blend(("a", "b"), None)
    assert parse_blend(["30", "a", "70", "b.idx"]) == Blend(("a", "b"), (30.0, 70.0))
    assert parse_blend(["1", "only"]) == Blend(("only",), None)
    assert parse_blend("single") == Blend(("single",), None)
    for bad in ([], ["1", "a", "b"], ["-1", "a", "2", "b"]):
        with pytest.raises(ConfigError, match="--data"):
            parse_blend(bad)


# --- datasets ---------------------------------------------------------------------------------


def test_lengths_types_and_keys(splits):
    train, valid = splits
    assert type(train).__name__ == "GPTDataset" and type(valid).__name__ == "GPTDataset"
    assert len(train) >= 1000 and len(valid) >= 50
    sample = train[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert sample["tokens"].shape == (SEQ,) and sample["tokens"].dtype == torch.int64
    assert sample["loss_mask"].dtype == torch.float32 and bool((sample["loss_mask"] == 1).all())
    assert sample["position_ids"].tolist() == list(range(SEQ))


def test_splits_use_disjoint_document_ranges(splits, indexed_prefix):
    train, valid = splits
    from epas_megatron.data.indexed import read_sequence_lengths

    n = read_sequence_lengths(indexed_prefix).shape[0]
    (t0, t1), (v0, v1), _ = split_ranges(n, parse_split(SPLIT))
    assert set(numpy.unique(train.document_index).tolist()) == set(range(t0, t1))
    assert set(numpy.unique(valid.document_index).tolist()) == set(range(v0, v1))


@pytest.mark.parametrize("which", [0, 1])
def test_samples_are_windows_of_the_eod_separated_document_stream(
    splits, which, tokenizer, small_documents
):
    dataset = splits[which]
    documents = document_tokens(tokenizer, small_documents)
    stream = numpy.concatenate([documents[d] for d in dataset.document_index])
    for i in range(0, len(dataset), max(1, len(dataset) // 40)):
        j = int(dataset.shuffle_index[i])
        window = stream[j * SEQ : j * SEQ + SEQ + 1]
        sample = dataset[i]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()


def test_build_is_deterministic_and_seeded(splits, indexed_prefix, tokenizer, tmp_path):
    train, _ = splits
    again, _ = build([indexed_prefix], tokenizer, tmp_path)
    other_seed, _ = build([indexed_prefix], tokenizer, tmp_path, seed=99)
    first = [train[i]["tokens"] for i in range(20)]
    assert all(torch.equal(a, again[i]["tokens"]) for i, a in enumerate(first))
    assert not all(torch.equal(a, other_seed[i]["tokens"]) for i, a in enumerate(first))


def test_no_valid_dataset_when_no_valid_samples(indexed_prefix, tokenizer, tmp_path):
    train, valid = build([indexed_prefix], tokenizer, tmp_path, valid_samples=0, split="1")
    assert valid is None and len(train) >= 1000


def test_eod_mask_loss(indexed_prefix, tokenizer, tmp_path):
    train, _ = build([indexed_prefix], tokenizer, tmp_path, eod_mask_loss=True)
    for i in range(50):
        sample = train[i]
        assert torch.equal(sample["loss_mask"] == 0, sample["tokens"] == tokenizer.eod)


def test_blend_with_and_without_weights(indexed_prefix, tokenizer, tmp_path):
    other = write_dataset(tmp_path / "other", ["omega " * 300] * 10, tokenizer)
    weighted, _ = build(["3", indexed_prefix, "1", other], tokenizer, tmp_path, valid_samples=0)
    assert len(weighted) >= 1000
    share = numpy.bincount(weighted.dataset_index, minlength=2) / len(weighted)
    assert abs(share[0] - 0.75) < 0.01
    by_tokens, _ = build([indexed_prefix, other], tokenizer, tmp_path, valid_samples=0)
    assert len(by_tokens) >= 1000  # weights from token counts: the requested size, not one epoch


def test_rewritten_dataset_never_reuses_stale_indices(tmp_path, tokenizer):
    prefix = write_dataset(tmp_path / "data", ["alpha beta gamma. " * 40] * 12, tokenizer)
    first, _ = build([prefix], tokenizer, tmp_path / "cache", train_samples=50, valid_samples=0)
    assert "alpha" in tokenizer.detokenize(first[0]["tokens"])
    write_dataset(tmp_path / "data", ["omega zeta. " * 30] * 7, tokenizer)
    second, _ = build([prefix], tokenizer, tmp_path / "cache", train_samples=50, valid_samples=0)
    text = tokenizer.detokenize(second[0]["tokens"])
    assert "omega" in text and "alpha" not in text


# --- errors -----------------------------------------------------------------------------------


def test_missing_prefix_names_data(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="--data"):
        build([str(tmp_path / "nowhere")], tokenizer, tmp_path)


def test_sequence_longer_than_data_names_seq_length(indexed_prefix, tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="--seq-length"):
        build([indexed_prefix], tokenizer, tmp_path, seq_length=10**6)


def test_empty_validation_split_names_split(tmp_path, tokenizer):
    prefix = write_dataset(tmp_path / "five", ["a small document. " * 50] * 5, tokenizer)
    with pytest.raises(ConfigError, match="valid split.*--split 969,30,1"):
        build([prefix], tokenizer, tmp_path, split="969,30,1")
    with pytest.raises(ConfigError, match="--split"):
        build([prefix], tokenizer, tmp_path, split="1,0,0")
    train, valid = build([prefix], tokenizer, tmp_path, split="969,30,1", valid_samples=0)
    assert valid is None and len(train) >= 1000


@pytest.mark.parametrize(
    "override, flag",
    [({"seq_length": 0}, "--seq-length"), ({"train_samples": 0}, "--train-iters"),
     ({"valid_samples": -1}, "--eval-iters")],
)
def test_bad_sizes_name_the_flag(indexed_prefix, tokenizer, tmp_path, override, flag):
    with pytest.raises(ConfigError, match=flag):
        build([indexed_prefix], tokenizer, tmp_path, **override)


# --- torch.distributed ------------------------------------------------------------------------


def test_single_rank_process_group(indexed_prefix, tokenizer, tmp_path, splits):
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        train, valid = build([indexed_prefix], tokenizer, tmp_path / "cache")
    finally:
        torch.distributed.destroy_process_group()
    assert torch.equal(train[7]["tokens"], splits[0][7]["tokens"])
    assert torch.equal(valid[3]["tokens"], splits[1][3]["tokens"])


def _rank_main(rank, world_size, rendezvous, prefix, tokenizer, cache_dir, queue):
    warnings.simplefilter("ignore")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
    )
    try:
        train, valid = build([prefix], tokenizer, cache_dir)
        train_tokens = [train[i]["tokens"].tolist() for i in range(5)]
        queue.put((rank, train_tokens, valid[0]["tokens"].tolist()))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_build_once_and_agree(indexed_prefix, tokenizer, tmp_path, splits):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    args = (2, tmp_path / "rendezvous", indexed_prefix, tokenizer, tmp_path / "cache", queue)
    processes = [context.Process(target=_rank_main, args=(rank, *args)) for rank in range(2)]
    for process in processes:
        process.start()
    results = {}
    for _ in processes:
        rank, train, valid = queue.get(timeout=120)
        results[rank] = (train, valid)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    expected_train = [splits[0][i]["tokens"].tolist() for i in range(5)]
    expected = (expected_train, splits[1][0]["tokens"].tolist())
    assert results[0] == results[1] == expected
    assert len(list((tmp_path / "cache").rglob("*-train-shuffle_index.npy"))) == 1
