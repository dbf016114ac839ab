"""Distributed checkpoints with Megatron-Core ``dist_checkpointing`` (PyTorch DCP underneath).

Layout of a checkpoint root::

    root/
      iter_0000100/           one dist checkpoint (model, optimizer, scheduler, RNG, train state)
        run_meta.json         model shape, parallel layout, EPAS schedule, iteration (plain JSON,
                              readable before any process group exists)
      iter_0000200/
      latest_checkpointed_iteration.txt   written last, atomically (temp file + rename)

A crash during a save leaves at most an incomplete ``iter_*`` directory that the pointer never
names; the next save of that iteration replaces it. Old checkpoints are pruned only after the
pointer moved on. Everything is loaded through ``weights_only=True`` paths (DCP for tensors and
objects; JSON for metadata); RNG states are stored as tensors and plain Python values only.

Because every tensor is saved under its global key (layers keyed by global index, QKV as
``linear_q/k/v``), a checkpoint loads into any TP/PP/VPP layout and any EPAS sharing region.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.errors import ConfigError
from epas_megatron.runtime.fs import atomic_write_text
from epas_megatron.runtime.rng import capture_rng_state, restore_rng_state
from epas_megatron.runtime.wrapping import unwrap_model

POINTER = "latest_checkpointed_iteration.txt"
META = "run_meta.json"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    """``root/iter_0000123``."""
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | os.PathLike) -> Optional[int]:
    """The iteration the pointer names, or None if the root holds no complete checkpoint."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    return int(text) if text.isdigit() else None


REQUIRED_META_KEYS = ("iteration", "model")
"""Keys of ``run_meta.json`` that every reader needs."""


def resolve_checkpoint(path: str | os.PathLike, flag: str = "--load") -> Optional[Path]:
    """A checkpoint root (-> its latest checkpoint) or an ``iter_*`` directory; None if empty.
    (:func:`epas_megatron.checkpointing.integrity.open_checkpoint` also checks it is whole.)"""
    path = Path(path)
    if (path / META).is_file():
        return path
    it = latest_iteration(path)
    if it is None:
        return None
    found = iteration_dir(path, it)
    if not (found / META).is_file():
        raise ConfigError(f"{flag} {path}: {POINTER} names iteration {it} but {found} is incomplete (no {META})")
    return found


def read_meta(checkpoint_dir: str | os.PathLike, required: Sequence[str] = REQUIRED_META_KEYS) -> dict[str, Any]:
    """The run metadata of one checkpoint (no process group needed); a ``ConfigError`` naming
    the file when it is unreadable or lacks a ``required`` key."""
    path = Path(checkpoint_dir) / META
    try:
        meta = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path} cannot be read ({error.strerror or error})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}): the checkpoint is damaged") from None
    missing = [key for key in required if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise ConfigError(f"{path} lacks {', '.join(missing)}: the checkpoint is damaged or was not written by epas-megatron")
    return meta


def read_checkpoint_meta(checkpoint_dir: str | os.PathLike) -> CheckpointMeta:
    """:func:`read_meta` as a typed :class:`~epas_megatron.checkpointing.metadata.CheckpointMeta`."""
    return CheckpointMeta.from_dict(read_meta(checkpoint_dir))


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _use_thread_queue() -> None:
    # megatron-core's filesystem writer collects write results in a multiprocessing Manager queue,
    # which starts a spawned server process (and re-imports __main__) on first use; its writers
    # are threads of this process, so a plain thread-safe queue does the same job.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _use_process_queue() -> None:
    # The asynchronous writer is a forked process: it reports its write results through a queue
    # the fork inherits (a pipe), created before the fork.
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = multiprocessing.get_context("fork").Queue()


def sharded_state(model_chunks: Sequence[torch.nn.Module], optimizer, scheduler, train_state: dict, *, loading: bool,
                  with_optimizer: bool = True, with_rng: bool = True) -> dict:
    """The sharded state dict of a whole training state (what save and load exchange)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    models = {}
    for i, chunk in enumerate(model_chunks):
        models["model" if i == 0 else f"model{i}"] = unwrap_model(chunk).sharded_state_dict()
    state: dict[str, Any] = dict(models)
    if with_optimizer and optimizer is not None:
        # Model-space optimizer states (one tensor per parameter, keyed like the parameter), so
        # that they follow the parameters through TP/PP/DP changes and EPAS switches; for the
        # distributed optimizer that is its 'fully_reshardable' format (gathered over DP).
        state["optimizer"] = optimizer.sharded_state_dict(models, is_loading=loading, metadata=OPTIMIZER_METADATA)
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["train_state"] = dict(train_state)
    if with_rng:
        pp, tp = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        state["rng_state"] = ShardedObject(
            "rng_state",
            capture_rng_state(),
            (pp, tp, parallel_state.get_data_parallel_world_size()),
            (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(), dp_rank),
            replica_id=0,
        )
    return state


def grad_scalers(optimizer) -> list:
    """The fp16 loss scalers of an optimizer (one per chained sub-optimizer; none otherwise)."""
    if optimizer is None:
        return []
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.grad_scaler for o in parts if getattr(o, "grad_scaler", None) is not None]


def scaler_states(optimizer) -> list[dict]:
    """Loss-scaler states as plain numbers (they are saved with the optimizer state, which does
    not exist before the first successful step -- but fp16 skips steps until its scale fits)."""
    states = []
    for scaler in grad_scalers(optimizer):
        state = scaler.state_dict()
        states.append({k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    return states


def restore_scaler_states(optimizer, states: list[dict]) -> None:
    from epas_megatron.runtime.device import compute_device

    for scaler, state in zip(grad_scalers(optimizer), states):
        if "scale" in state:
            state = {**state, "scale": torch.tensor([state["scale"]], dtype=torch.float32, device=compute_device())}
        scaler.load_state_dict(state)


def optimizer_has_state(optimizer) -> bool:
    """Whether any parameter has optimizer state yet (none before the first step)."""
    if optimizer is None:
        return False
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(getattr(getattr(o, "optimizer", o), "state", {})) > 0 for o in parts)


def _begin_save(root: Path, iteration: int) -> Path:
    """An empty ``root/iter_NNNNNNN`` (a half-written one of this iteration is replaced: the
    pointer never named it)."""
    target = iteration_dir(root, iteration)
    if _rank0():
        root.mkdir(parents=True, exist_ok=True)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir()
    _barrier()
    return target


def _state_to_save(model_chunks, optimizer, scheduler, train_state: dict) -> tuple[dict, bool]:
    """(sharded state, whether it holds optimizer state)."""
    with_optimizer = optimizer_has_state(optimizer)
    if not with_optimizer and grad_scalers(optimizer):
        train_state = {**train_state, "grad_scalers": scaler_states(optimizer)}
    return sharded_state(model_chunks, optimizer, scheduler, train_state, loading=False, with_optimizer=with_optimizer), with_optimizer


def _complete_save(root: Path, target: Path, iteration: int, meta: dict, with_optimizer: bool, keep_last: int) -> None:
    """After every rank's data is written: run_meta.json, then the pointer, then pruning."""
    _barrier()
    if _rank0():
        record = {**meta, "iteration": iteration, "has_optimizer_state": with_optimizer}
        (target / META).write_text(json.dumps(record, indent=1, sort_keys=True))
        atomic_write_text(root / POINTER, str(iteration))
        if keep_last > 0:
            prune(root, keep_last)
    _barrier()


def save_checkpoint(
    root: str | os.PathLike,
    iteration: int,
    model_chunks,
    optimizer,
    scheduler,
    train_state: dict,
    meta: dict,
    keep_last: int = 0,
) -> Path:
    """Save a full training state as ``root/iter_NNNNNNN``, then move the pointer to it.

    ``optimizer=None`` saves the model only (e.g. an imported model)."""
    from megatron.core import dist_checkpointing

    _use_thread_queue()
    root = Path(root)
    target = _begin_save(root, iteration)
    state, with_optimizer = _state_to_save(model_chunks, optimizer, scheduler, train_state)
    dist_checkpointing.save(state, str(target))
    _complete_save(root, target, iteration, meta, with_optimizer, keep_last)
    return target


class AsyncCheckpointer:
    """Checkpoint saves that run while training goes on (``--async-save``), with Megatron-Core's
    asynchronous ``torch_dist`` writer.

    :meth:`save` takes the state (on a GPU: copies it to host memory) and forks a writer process
    per rank; the trainer keeps stepping. :meth:`poll` (every iteration, on every rank) completes
    the saves whose writers have finished *on every rank*: only then are the checkpoint's global
    metadata, ``run_meta.json`` and the ``latest`` pointer written -- a run killed mid-save
    leaves the previous checkpoint as the latest, whole and resumable. A save still in flight is
    completed before the next one starts (:meth:`finish`), and at the end of training. On CPU
    the writer sees the fork's copy-on-write snapshot of the state, so training may overwrite
    the tensors at once.
    """

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._calls = AsyncCallsQueue(persistent=False)
        self._in_flight: list[Path] = []

    @property
    def in_flight(self) -> list[Path]:
        """Checkpoints being written (not the latest yet)."""
        return list(self._in_flight)

    def save(self, root: str | os.PathLike, iteration: int, model_chunks, optimizer, scheduler, train_state: dict, meta: dict,
             keep_last: int = 0) -> Path:
        """Start saving ``root/iter_NNNNNNN`` (after completing any save in flight)."""
        from functools import partial

        from megatron.core import dist_checkpointing

        self.finish()
        _use_process_queue()
        root = Path(root)
        target = _begin_save(root, iteration)
        state, with_optimizer = _state_to_save(model_chunks, optimizer, scheduler, train_state)
        request = dist_checkpointing.save(state, str(target), async_sharded_save=True, async_strategy="mcore")
        request.add_finalize_fn(partial(_complete_save, root, target, iteration, meta, with_optimizer, keep_last))
        self._calls.schedule_async_request(request)
        self._in_flight.append(target)
        return target

    def poll(self) -> list[Path]:
        """Complete the saves that every rank has finished writing; returns them. Collective."""
        done = self._calls.maybe_finalize_async_calls(blocking=False)
        finished, self._in_flight = self._in_flight[: len(done)], self._in_flight[len(done):]
        return finished

    def finish(self) -> list[Path]:
        """Wait for and complete every save in flight; returns them. Collective."""
        if not self._in_flight:
            return []
        self._calls.maybe_finalize_async_calls(blocking=True)
        finished, self._in_flight = self._in_flight, []
        return finished


def checkpoint_iterations(root: str | os.PathLike) -> list[int]:
    """Iterations of the ``iter_NNNNNNN`` directories under ``root`` (complete or not), ascending."""
    return sorted(int(p.name[5:]) for p in Path(root).glob("iter_*") if p.name[5:].isdigit())


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints up to the latest (never the
    latest). Checkpoints newer than the latest -- damaged ones a run fell back from -- are left
    alone: a later save of that iteration replaces them."""
    latest = latest_iteration(root)
    done = [it for it in checkpoint_iterations(root)
            if (iteration_dir(root, it) / META).is_file() and (latest is None or it <= latest)]
    for it in done[:-keep_last]:
        if it != latest:
            shutil.rmtree(iteration_dir(root, it), ignore_errors=True)


def load_checkpoint(
    checkpoint_dir: str | os.PathLike,
    model_chunks,
    optimizer=None,
    scheduler=None,
    *,
    restore_rng: bool = True,
    weights_only: bool = False,
) -> dict:
    """Load into built model chunks (and optimizer/scheduler if given); returns train_state.

    ``restore_rng`` only applies when the checkpoint was written with the same TP/PP/DP sizes.
    ``weights_only``: the model's weights alone (``--pretrained``: a fresh optimizer, LR schedule
    and loss scale); an ``optimizer`` given then only has its main weights refreshed from them.
    """
    from megatron.core import dist_checkpointing

    # Before the first optimizer step there is no optimizer state to restore (fresh == saved).
    with_optimizer = (optimizer is not None and not weights_only
                      and CheckpointMeta.from_dict(read_meta(checkpoint_dir, required=())).has_optimizer_state)
    state = sharded_state(model_chunks, optimizer if with_optimizer else None, scheduler, {}, loading=True,
                          with_optimizer=with_optimizer, with_rng=restore_rng)
    loaded = dist_checkpointing.load(state, str(checkpoint_dir))
    if weights_only:
        loaded.pop("train_state", None)
    return apply_loaded_state(loaded, model_chunks, optimizer, scheduler, with_optimizer=with_optimizer, restore_rng=restore_rng)


def refresh_main_weights(optimizer) -> None:
    """Copy the model's weights into the optimizer's fp32 main weights (Megatron-Core's
    ``reload_model_params``): after any load that leaves the optimizer state behind.

    The mixed-precision and distributed optimizers copy their main weights from the model when
    they are built; a model whose weights are loaded afterwards -- every build with
    ``load_follows``: a resume, a switch, ``--pretrained`` -- would otherwise step from those
    stale copies (memory never initialised) and write them back into the model. The fp32
    optimizer steps the model's own parameters and has nothing to refresh."""
    if optimizer is not None:
        optimizer.reload_model_params()


def apply_loaded_state(loaded: dict, model_chunks, optimizer, scheduler, *, with_optimizer: bool, restore_rng: bool,
                       with_model: bool = True) -> dict:
    """Put a loaded state dict (what ``dist_checkpointing.load`` returns for
    :func:`sharded_state`, or the in-memory switch assembles) into the built objects; returns
    train_state. ``with_model=False``: the optimizer's part only (the model's is loaded).

    With an ``optimizer`` but no optimizer state (a checkpoint saved before the first step, a
    weights-only load), the optimizer's main weights are refreshed from the loaded model; with
    optimizer state they come from it (the fp32 main weights a mixed-precision run saved)."""
    for i, chunk in enumerate(model_chunks if with_model else ()):
        unwrap_model(chunk).load_state_dict(loaded["model" if i == 0 else f"model{i}"], strict=True)
    if with_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        refresh_main_weights(optimizer)
        if optimizer is not None and "grad_scalers" in loaded.get("train_state", {}):
            restore_scaler_states(optimizer, loaded["train_state"]["grad_scalers"])
    if restore_rng and "rng_state" in loaded:
        restore_rng_state(loaded["rng_state"])
    return loaded.get("train_state", {})
