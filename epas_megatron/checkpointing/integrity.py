"""Is a checkpoint whole? Checked before any process group exists, so that a damaged one is a
one-line error naming the file (or a stated fall-back to an older one), never a traceback from
deep inside a load.

What is checked, per ``iter_*`` directory, without reading any tensor:

* ``run_meta.json`` parses and has the keys every reader needs (:data:`REQUIRED_META_KEYS`);
* PyTorch DCP's index (``.metadata``) loads, and every data file it names exists and is at
  least as long as the furthest byte the index reads from it -- a truncated or missing
  ``*.distcp`` (an interrupted copy, a full disk, a node lost during a save) is found here.

Bit flips inside a file of the right length are not detected (no checksums are written).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint import FileSystemReader

from epas_megatron.checkpointing.checkpoint import checkpoint_iterations, iteration_dir, read_meta, resolve_checkpoint
from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.errors import ConfigError

DCP_INDEX = ".metadata"
"""PyTorch DCP's index of a checkpoint: which byte ranges of which files hold each tensor."""


def checkpoint_problem(checkpoint_dir: str | os.PathLike) -> Optional[str]:
    """Why the checkpoint in ``checkpoint_dir`` cannot be loaded, or None if it looks whole."""
    directory = Path(checkpoint_dir)
    try:
        read_meta(directory)
    except ConfigError as error:
        return str(error)
    index = directory / DCP_INDEX
    if not index.is_file():
        return f"{index} is missing"
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as error:  # an unreadable index: any exception of the unpickler
        return f"{index} cannot be read ({type(error).__name__}: {error})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        actual = path.stat().st_size
        if actual < size:
            return f"{path} is truncated ({actual} bytes, the index reads up to byte {size})"
    return None


def open_checkpoint(path: str | os.PathLike, flag: str, needs_config: bool = False) -> tuple[Path, CheckpointMeta]:
    """(checkpoint directory, its run metadata) for ``path`` -- a checkpoint root (its latest
    checkpoint) or an ``iter_*`` directory -- checked whole; a ``ConfigError`` naming ``flag``
    and the file otherwise. ``needs_config``: the metadata must hold the run config (readers that
    rebuild the run's model and data from it)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: not a directory")
    checkpoint = resolve_checkpoint(path, flag)
    if checkpoint is None:
        raise ConfigError(f"{flag} {path}: no checkpoint there")
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ConfigError(f"{flag} {path}: checkpoint {checkpoint.name} is damaged: {problem}")
    meta = CheckpointMeta.from_dict(read_meta(checkpoint))
    if needs_config and meta.config is None:
        raise ConfigError(f"{flag} {path}: checkpoint metadata has no run config (written by an older version)")
    return checkpoint, meta


def newest_sound_checkpoint(root: str | os.PathLike, at_most: int) -> tuple[Optional[Path], list[str]]:
    """The newest checkpoint under ``root`` at an iteration ``<= at_most`` that is whole, and a
    line per newer one skipped (which, and why)."""
    skipped = []
    for iteration in reversed(checkpoint_iterations(root)):
        if iteration > at_most:
            continue
        directory = iteration_dir(root, iteration)
        problem = checkpoint_problem(directory)
        if problem is None:
            return directory, skipped
        skipped.append(f"{directory.name}: {problem}")
    return None, skipped
