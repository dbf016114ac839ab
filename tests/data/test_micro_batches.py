"""The resumable micro-batch iterator: index order, DP slicing, resume, exhaustion, collation."""

import itertools
import warnings

import pytest
import torch

from epas_megatron.data.datasets import (
    DataExhaustedError,
    build_data_iterator,
    build_gpt_datasets,
    collate_samples,
    micro_batch_indices,
)
from epas_megatron.errors import ConfigError

warnings.filterwarnings("ignore", category=UserWarning)


class IndexDataset:
    """Sample i is a constant sequence of i (so batches show which samples they hold)."""

    def __init__(self, size, seq=4):
        self.size, self.seq = size, seq

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        row = torch.full((self.seq,), i, dtype=torch.int64)
        return {"tokens": row, "labels": row + 1, "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq), "dataset_id": 0}


def sample_ids(batch):
    return batch["tokens"][:, 0].tolist()


def test_hand_computed_indices():
    # total 10, micro-batch 2, DP 2: chunks [0..3], [4..7]; 8, 9 cannot fill a chunk.
    assert list(micro_batch_indices(10, 0, 2, 0, 2)) == [[0, 1], [4, 5]]
    assert list(micro_batch_indices(10, 0, 2, 1, 2)) == [[2, 3], [6, 7]]
    assert list(micro_batch_indices(10, 4, 2, 1, 2)) == [[6, 7]]
    assert list(micro_batch_indices(10, 8, 2, 0, 2)) == []
    # single rank: consecutive micro-batches
    assert list(micro_batch_indices(7, 1, 3, 0, 1)) == [[1, 2, 3], [4, 5, 6]]
    # cycle: positions wrap modulo the dataset length
    cycled = micro_batch_indices(10, 8, 2, 0, 2, cycle=True)
    assert list(itertools.islice(cycled, 4)) == [[8, 9], [2, 3], [6, 7], [0, 1]]


@pytest.mark.parametrize("micro_batch_size, dp", [(1, 1), (3, 1), (2, 4), (4, 3)])
def test_ranks_partition_each_chunk_in_order(micro_batch_size, dp):
    total = 100
    per_rank = [list(micro_batch_indices(total, 0, micro_batch_size, r, dp)) for r in range(dp)]
    chunk = micro_batch_size * dp
    steps = total // chunk
    assert all(len(batches) == steps for batches in per_rank)
    for step in range(steps):
        merged = [i for r in range(dp) for i in per_rank[r][step]]
        assert merged == list(range(step * chunk, (step + 1) * chunk))


def test_batches_are_collated_tensors_of_the_right_samples():
    iterator = build_data_iterator(IndexDataset(20), 3, 1, 2)
    batch = next(iterator)
    assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids", "sample_ids"}
    assert sample_ids(batch) == [3, 4, 5] and batch["sample_ids"].tolist() == [3, 4, 5]
    assert batch["tokens"].shape == (3, 4) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert iterator.consumed_samples == 6
    assert sample_ids(next(iterator)) == [9, 10, 11] and iterator.consumed_samples == 12


def test_collate_casts_dtypes():
    samples = [{"tokens": torch.tensor([1, 2], dtype=torch.int32), "labels": [2, 3],
                "loss_mask": torch.tensor([1, 0], dtype=torch.float64), "position_ids": [0, 1]}]
    batch = collate_samples(samples)
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert batch["loss_mask"].tolist() == [[1.0, 0.0]]


def test_exhaustion_raises_a_clear_error_and_cycle_wraps():
    iterator = build_data_iterator(IndexDataset(10), 2, 0, 2)
    assert [sample_ids(b) for b in itertools.islice(iterator, 2)] == [[0, 1], [4, 5]]
    with pytest.raises(DataExhaustedError, match="--train-iters"):
        next(iterator)
    cycling = build_data_iterator(IndexDataset(10), 2, 0, 2, cycle=True)
    assert [sample_ids(b) for b in itertools.islice(cycling, 4)] == [[0, 1], [4, 5], [8, 9], [2, 3]]


def test_bad_arguments():
    with pytest.raises(ConfigError, match="--micro-batch-size"):
        build_data_iterator(IndexDataset(5), 3, 0, 2)
    with pytest.raises(ConfigError, match="--micro-batch-size"):
        build_data_iterator(IndexDataset(5), 0, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        build_data_iterator(IndexDataset(50), 2, 2, 2)
    with pytest.raises(ConfigError, match="consumed_samples"):
        build_data_iterator(IndexDataset(50), 2, 0, 2, consumed_samples=-4)


@pytest.fixture(scope="module")
def train_dataset(indexed_prefix, tokenizer, tmp_path_factory):
    train, _ = build_gpt_datasets(
        [indexed_prefix], "1", seq_length=32, train_samples=200, valid_samples=0, seed=7,
        tokenizer=tokenizer, cache_dir=tmp_path_factory.mktemp("cache"),
    )
    return train


@pytest.mark.parametrize("dp, rank", [(1, 0), (2, 1), (3, 2)])
def test_resume_yields_the_uninterrupted_batches(train_dataset, dp, rank):
    micro_batch_size, steps, resume_at = 2, 12, 5
    chunk = micro_batch_size * dp
    whole_run = build_data_iterator(train_dataset, micro_batch_size, rank, dp)
    uninterrupted = list(itertools.islice(whole_run, steps))
    first = build_data_iterator(train_dataset, micro_batch_size, rank, dp)
    for _ in range(resume_at):
        next(first)
    assert first.consumed_samples == resume_at * chunk  # what a checkpoint would store
    resumed = build_data_iterator(train_dataset, micro_batch_size, rank, dp, first.consumed_samples)
    for expected in uninterrupted[resume_at:]:
        batch = next(resumed)
        for key in expected:
            assert torch.equal(batch[key], expected[key])
    # and the batches are the dataset's samples at the hand-computed indices
    for step, batch in enumerate(uninterrupted):
        indices = [step * chunk + rank * micro_batch_size + j for j in range(micro_batch_size)]
        expected = torch.stack([train_dataset[i]["tokens"] for i in indices])
        assert torch.equal(batch["tokens"], expected)


@pytest.mark.parametrize("total,consumed,mbs,dp", [(20, 0, 2, 1), (20, 4, 2, 3), (37, 6, 3, 2), (64, 8, 4, 4)])
def test_indices_equal_megatron_lms_pretraining_sampler(total, consumed, mbs, dp):
    """Megatron-LM's own sampler (``megatron.training``, shipped in the wheel but tied to its
    global-args training loop) is the reference for the non-cycling order."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from epas_megatron.data.datasets import micro_batch_indices

    for rank in range(dp):
        theirs = list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp, drop_last=True))
        ours = list(micro_batch_indices(total, consumed, mbs, rank, dp))
        assert ours == theirs, (rank, ours[:3], theirs[:3])


class CountingDataset(IndexDataset):
    """An IndexDataset that counts its reads."""

    reads = 0

    def __getitem__(self, i):
        CountingDataset.reads += 1
        return super().__getitem__(i)


def test_a_stage_reads_only_what_it_uses():
    """First stage: tokens and positions; last: labels and loss mask; a middle stage: only the
    sample ids, and it reads nothing from the dataset (as Megatron-LM's get_batch)."""
    def two(iterator):
        return list(itertools.islice(iterator, 2))

    full = two(build_data_iterator(IndexDataset(12), 2, 1, 2, consumed_samples=4))
    first = two(build_data_iterator(IndexDataset(12), 2, 1, 2, 4, keys=("tokens", "position_ids", "sample_ids")))
    last = two(build_data_iterator(IndexDataset(12), 2, 1, 2, 4, keys=("labels", "loss_mask", "sample_ids")))
    CountingDataset.reads = 0
    middle = two(build_data_iterator(CountingDataset(12), 2, 1, 2, 4, keys=("sample_ids",)))
    assert CountingDataset.reads == 0
    assert len(full) == len(first) == len(last) == len(middle) == 2
    for whole, f, l, m in zip(full, first, last, middle):
        assert set(f) == {"tokens", "position_ids", "sample_ids"} and set(l) == {"labels", "loss_mask", "sample_ids"}
        assert set(m) == {"sample_ids"}
        for part in (f, l, m):
            for key, value in part.items():
                assert torch.equal(value, whole[key]), key
    assert [m["sample_ids"].tolist() for m in middle] == [[6, 7], [10, 11]]  # hand-computed: rank 1 of chunks 1 and 2
    with pytest.raises(ValueError, match="unknown batch keys"):
        build_data_iterator(IndexDataset(12), 2, 0, 1, keys=("tokens", "attention_mask"))


def test_stage_batch_keys():
    from types import SimpleNamespace

    from epas_megatron.engine.step import stage_batch_keys

    def chunk(pre, post):  # wrapped as DDP(Float16Module(model)) is: .module twice
        return SimpleNamespace(module=SimpleNamespace(module=SimpleNamespace(pre_process=pre, post_process=post)))

    assert stage_batch_keys(chunk(True, True)) == ("tokens", "position_ids", "labels", "loss_mask", "sample_ids")
    assert stage_batch_keys(chunk(True, False)) == ("tokens", "position_ids", "sample_ids")
    assert stage_batch_keys(chunk(False, True)) == ("labels", "loss_mask", "sample_ids")
    assert stage_batch_keys(chunk(False, False)) == ("sample_ids",)
