"""Train/valid GPT datasets (Megatron-Core) and the resumable micro-batch iterator.

**Datasets** (:func:`build_gpt_datasets`): Megatron-Core's ``BlendedMegatronDatasetBuilder``
builds ``GPTDataset`` splits (or a ``BlendedDataset`` over several prefixes) from indexed datasets.

- ``--data`` is a list of prefixes, or Megatron's flattened ``weight prefix weight prefix ...``
  form. Several prefixes without weights are weighted by their token counts, so every split gets
  exactly the requested number of samples (Megatron would otherwise build one epoch of each).
- ``--split`` (e.g. ``969,30,1``) cuts each dataset into contiguous ranges of documents, as
  Megatron does. Only train and valid are built: the test share is held out and never read, and
  valid is not built when ``valid_samples`` is 0 (then ``None`` is returned for it).
- A ``GPTDataset`` repeats (reshuffled) epochs of its split until it holds the requested number
  of samples, and orders samples by a permutation seeded by ``seed``; samples are packed from
  consecutive documents separated by their EOD tokens (no attention reset, no EOD loss masking by
  default; causal masking is left to the attention kernel, so no attention mask is built).
- Checks that Megatron would turn into an assertion deep inside, or an endless loop (a split
  with no documents), run first and raise :class:`ConfigError` naming ``--data``/``--split``/
  ``--seq-length``: every dataset's train split (and valid split when ``valid_samples > 0``) must
  hold at least ``seq_length + 1`` tokens.
- Index caches go under ``cache_dir/gpt-indices/<fingerprint>``, where the fingerprint hashes
  the ``.idx`` files: a dataset rewritten under the same prefix never reuses stale indices.
  With ``torch.distributed`` initialized, rank 0 builds the caches while the other ranks wait at
  Megatron's barrier and then load them, so ``cache_dir`` must be visible to all ranks.

**Iterator** (:func:`build_data_iterator`), like Megatron-LM's ``MegatronPretrainingSampler``:
samples are consumed in index order in chunks of ``micro_batch_size * data_parallel_size``; data
parallel rank ``r`` takes positions ``[r * mbs, (r + 1) * mbs)`` of each chunk. Starting from
``consumed_samples = K`` yields exactly what an uninterrupted iterator yields after ``K`` samples
(``K`` counts all ranks' samples, and is what the trainer checkpoints). When the dataset runs
out, the iterator raises :class:`DataExhaustedError` (a partial last chunk is dropped), or with
``cycle=True`` continues from sample 0 (sample positions are taken modulo the dataset length).
Batches are dicts of CPU tensors: ``tokens``, ``labels``, ``position_ids`` (int64, ``[b, s]``),
``loss_mask`` (float32, ``[b, s]``) and ``sample_ids`` (int64, ``[b]``: each sample's stream
position, modulo the dataset length when cycling). ``keys`` selects what a pipeline stage uses
(the first: tokens and positions; the last: labels and loss mask; every stage: sample ids): a
stage that needs no token data reads nothing from the dataset, as Megatron-LM's ``get_batch``
returns nothing on middle stages. With a GPU the tensors are in pinned host memory, so the
copy to the device is asynchronous (``non_blocking``).

Why not Megatron-LM's sampler itself: ``MegatronPretrainingSampler`` ships in the wheel but in
``megatron.training``, whose data loader reads the global training arguments; it cannot cycle
(validation re-reads its split), and it asserts where we raise errors that name a flag. The index
order is the same, and a test checks it against that sampler.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy
import torch

from epas_megatron.data.indexed import (
    indexed_fingerprint,
    normalize_prefix,
    read_sequence_lengths,
)
from epas_megatron.errors import ConfigError

__all__ = [
    "BATCH_KEYS",
    "Blend",
    "DataExhaustedError",
    "MicroBatchIterator",
    "build_data_iterator",
    "build_gpt_datasets",
    "collate_samples",
    "micro_batch_indices",
    "parse_blend",
    "parse_split",
    "split_parts",
    "split_ranges",
]

BATCH_KEYS = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
}
"""Keys of a batch and their dtypes (other keys of a sample, e.g. ``dataset_id``, are dropped)."""

SPLIT_NAMES = ("train", "valid", "test")
"""Order of the shares in ``--split``."""

_NUMBER = re.compile(r"^(\d+(\.\d*)?|\.\d+)$")


# ---------------------------------------------------------------------------------------------
# Flags: blend and split
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Blend:
    """Dataset prefixes and their sampling weights."""

    prefixes: tuple[str, ...]
    """Indexed-dataset prefixes (``<prefix>.bin``/``.idx``)."""

    weights: tuple[float, ...] | None
    """Relative sampling weight per prefix; None: weight by token count."""


def _as_weight(text: str) -> float | None:
    try:
        weight = float(text)
    except ValueError:
        return None
    return weight if math.isfinite(weight) else None


def parse_blend(data: Sequence[str] | Blend) -> Blend:
    """``["a", "b"]`` or ``["30", "a", "70", "b"]`` (Megatron's ``--data-path`` forms) -> Blend."""
    if isinstance(data, Blend):
        return data
    if isinstance(data, (str, Path)):
        data = [str(data)]
    items = [str(item) for item in data]
    if not items:
        raise ConfigError("--data: no dataset prefix given")
    weights = [_as_weight(item) for item in items[0::2]]
    if len(items) % 2 == 0 and all(w is not None for w in weights):
        prefixes = tuple(normalize_prefix(p) for p in items[1::2])
        if any(w <= 0 for w in weights):
            raise ConfigError(f"--data: blend weights must be positive, got {weights}")
        return Blend(prefixes, tuple(weights) if len(prefixes) > 1 else None)
    if any(_as_weight(item) is not None for item in items):
        raise ConfigError(
            f"--data: {items} mixes numbers and paths; give prefixes only, or "
            "'weight prefix' pairs"
        )
    return Blend(tuple(normalize_prefix(p) for p in items), None)


def split_parts(split: str) -> list[str]:
    """The number strings of ``--split`` (``"969,30,1"`` -> ``["969", "30", "1"]``), validated."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split))]
    if not 1 <= len(parts) <= 3 or not all(_NUMBER.match(p) for p in parts):
        raise ConfigError(
            f"--split: {split!r} must be 1 to 3 non-negative numbers separated by commas, "
            "e.g. 969,30,1 (train, valid, test)"
        )
    if sum(float(p) for p in parts) <= 0:
        raise ConfigError(f"--split: {split!r} gives every split a zero share")
    return parts


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalized train/valid/test shares (missing shares are 0)."""
    shares = numpy.array(
        [float(p) for p in split_parts(split)] + [0.0] * (3 - len(split_parts(split))),
        dtype=numpy.float64,
    )
    # Same arithmetic as Megatron's parse_and_normalize_split, so the ranges below match its own.
    return (shares / numpy.sum(shares)).tolist()


def split_ranges(num_sequences: int, shares: Sequence[float]) -> list[tuple[int, int] | None]:
    """Sequence-index range of each split, rounded exactly as Megatron's builder rounds them."""
    bookends = [0.0]
    for share in shares:
        bookends.append(bookends[-1] + share)
    ranges = []
    for begin, end in zip(bookends[:-1], bookends[1:]):
        if end <= begin:
            ranges.append(None)
        else:
            ranges.append(
                (int(round(begin * float(num_sequences))), int(round(end * float(num_sequences))))
            )
    return ranges


def _check_positive(value: int, flag: str, minimum: int = 1) -> None:
    if not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{flag}: must be an integer >= {minimum}, got {value!r}")


def check_split_sizes(
    prefix: str,
    lengths: numpy.ndarray,
    shares: Sequence[float],
    split: str,
    seq_length: int,
    needed: Sequence[str],
) -> None:
    """Each needed split of one dataset must hold at least ``seq_length + 1`` tokens."""
    for name, bounds in zip(SPLIT_NAMES, split_ranges(lengths.shape[0], shares)):
        if name not in needed:
            continue
        begin, end = bounds if bounds is not None else (0, 0)
        tokens = int(lengths[begin:end].sum(dtype=numpy.int64))
        if tokens < seq_length + 1:
            raise ConfigError(
                f"--data: the {name} split of {prefix} holds {tokens} tokens in {end - begin} "
                f"documents (--split {split} gives it documents [{begin}, {end}) of "
                f"{lengths.shape[0]}), fewer than --seq-length + 1 = {seq_length + 1}. Use more "
                f"data, a larger {name} share in --split, or a smaller --seq-length"
            )


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------


def _always() -> bool:
    return True


def build_gpt_datasets(
    data_prefixes: Sequence[str] | Blend,
    split: str = "969,30,1",
    *,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
    seed: int,
    tokenizer,
    cache_dir: str | Path,
    is_built_on_rank: Callable[[], bool] | None = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
):
    """Build ``(train_dataset, valid_dataset)`` with Megatron-Core (see module doc).

    ``tokenizer`` needs ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers``
    (:class:`.tokenizer.SentencePieceTokenizer`). ``valid_dataset`` is None when
    ``valid_samples`` is 0. Under ``torch.distributed``, call on every rank; a rank where
    ``is_built_on_rank()`` is False (default: every rank builds) gets ``(None, None)``.
    """
    _check_positive(seq_length, "--seq-length")
    _check_positive(train_samples, "--train-iters")
    _check_positive(valid_samples, "--eval-iters", minimum=0)
    blend = parse_blend(data_prefixes)
    shares = parse_split(split)
    needed = ["train"] + (["valid"] if valid_samples > 0 else [])
    if valid_samples > 0 and shares[1] == 0:
        raise ConfigError(
            f"--split: {split!r} gives the validation split no share but {valid_samples} "
            "validation samples are requested; e.g. use --split 969,30,1"
        )
    if shares[0] == 0:
        raise ConfigError(f"--split: {split!r} gives the training split no share")
    lengths = {prefix: read_sequence_lengths(prefix) for prefix in blend.prefixes}
    for prefix in blend.prefixes:
        check_split_sizes(prefix, lengths[prefix], shares, split, seq_length, needed)
    weights = blend.weights
    if weights is None and len(blend.prefixes) > 1:
        weights = tuple(float(lengths[p].sum(dtype=numpy.int64)) for p in blend.prefixes)

    with warnings.catch_warnings():  # Megatron-Core warns about absent GPU libraries
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefixes = [str(Path(p).resolve()) for p in blend.prefixes]
    cache = Path(cache_dir) / "gpt-indices" / indexed_fingerprint(blend.prefixes)[:16]
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, list(weights) if weights is not None else None),
        split=",".join(split_parts(split)),
        path_to_cache=str(cache),
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
    )
    # Build only what is used: the test share stays held out, valid only when asked for.
    config.split_matrix[2] = None
    if valid_samples == 0:
        config.split_matrix[1] = None
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset,
        [train_samples, valid_samples, 0],
        is_built_on_rank or _always,
        config,
    )
    train, valid, _test = builder.build()
    return train, valid


# ---------------------------------------------------------------------------------------------
# Micro-batch iterator
# ---------------------------------------------------------------------------------------------


class DataExhaustedError(RuntimeError):
    """The iterator needs more samples than the dataset was built with."""


def micro_batch_indices(
    total_samples: int,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    cycle: bool = False,
) -> Iterator[list[int]]:
    """Sample indices of this rank's micro-batches, starting after ``consumed_samples``.

    Chunk ``i`` covers stream positions ``[K + i * mbs * dp, K + (i + 1) * mbs * dp)`` and this
    rank takes the ``data_parallel_rank``-th slice of ``micro_batch_size`` of it. Without
    ``cycle`` the iteration ends before a chunk that would run past ``total_samples``; with it,
    positions wrap modulo ``total_samples``.
    """
    chunk = micro_batch_size * data_parallel_size
    offset = data_parallel_rank * micro_batch_size
    position = consumed_samples
    while cycle or position + chunk <= total_samples:
        yield [(position + offset + j) % total_samples for j in range(micro_batch_size)]
        position += chunk


def collate_samples(samples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stack the samples' :data:`BATCH_KEYS` into ``[b, s]`` tensors of the listed dtypes."""
    return {
        key: torch.stack([torch.as_tensor(sample[key]) for sample in samples]).to(dtype)
        for key, dtype in BATCH_KEYS.items()
    }


class MicroBatchIterator:
    """Iterator of this rank's micro-batches (see module doc); checkpoint ``consumed_samples``."""

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        consumed_samples: int = 0,
        cycle: bool = False,
        keys: Optional[Sequence[str]] = None,
        pin_memory: Optional[bool] = None,
    ):
        _check_positive(micro_batch_size, "--micro-batch-size")
        unknown = set(keys or ()) - set(BATCH_KEYS) - {"sample_ids"}
        if unknown:
            raise ValueError(f"unknown batch keys {sorted(unknown)}; choose from {[*BATCH_KEYS, 'sample_ids']}")
        _check_positive(data_parallel_size, "data_parallel_size")
        _check_positive(consumed_samples, "consumed_samples", minimum=0)
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})"
            )
        chunk = micro_batch_size * data_parallel_size
        if len(dataset) < chunk:
            raise ConfigError(
                f"--micro-batch-size: the dataset holds {len(dataset)} samples, fewer than one "
                f"micro-batch on every data-parallel rank ({micro_batch_size} x "
                f"{data_parallel_size} = {chunk}); request more samples or a smaller batch"
            )
        self.dataset = dataset
        """The map-style dataset samples are read from."""
        self.micro_batch_size = micro_batch_size
        """Samples per micro-batch on this rank."""
        self.data_parallel_size = data_parallel_size
        """Number of data-parallel ranks sharing each chunk."""
        self.consumed_samples = consumed_samples
        """Samples consumed by all ranks so far (advances by ``mbs * dp`` per micro-batch)."""
        self.cycle = cycle
        """Wrap around at the end instead of raising :class:`DataExhaustedError`."""
        self.keys = tuple(keys) if keys is not None else (*BATCH_KEYS, "sample_ids")
        """The batch entries yielded (the dataset is read only if one of them is token data)."""
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        """Yield tensors in pinned host memory (default: when a GPU is present)."""
        self._indices = micro_batch_indices(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank,
            data_parallel_size, cycle,
        )

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        indices = next(self._indices, None)
        if indices is None:
            raise DataExhaustedError(
                f"the dataset's {len(self.dataset)} samples are used up after "
                f"{self.consumed_samples} consumed samples (a partial last batch is dropped); "
                "build the dataset with more samples (--train-iters / --eval-iters) or "
                "iterate with cycle=True"
            )
        batch = {}
        if any(key in BATCH_KEYS for key in self.keys):
            batch = collate_samples([self.dataset[i] for i in indices])
        # [b] the samples' stream positions (Random-LTD keys its token draws with them)
        batch["sample_ids"] = torch.tensor(indices, dtype=torch.int64)
        self.consumed_samples += self.micro_batch_size * self.data_parallel_size
        batch = {key: batch[key] for key in self.keys}
        if self.pin_memory:
            batch = {key: value.pin_memory() for key, value in batch.items()}
        return batch


def build_data_iterator(
    dataset,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    consumed_samples: int = 0,
    cycle: bool = False,
    keys: Optional[Sequence[str]] = None,
) -> MicroBatchIterator:
    """This rank's micro-batches of ``dataset`` after ``consumed_samples`` (see module doc);
    ``keys``: the batch entries this rank's model chunk uses (None: all)."""
    return MicroBatchIterator(
        dataset, micro_batch_size, data_parallel_rank, data_parallel_size, consumed_samples, cycle, keys
    )
