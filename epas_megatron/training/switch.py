"""The switch event: the one place where the sharing region of a run changes.

The schedule decides *what* changes; :class:`SwitchExecutor` carries it out by rebuilding model
chunks (new layer specs, and a new pipeline layout when stages are rebalanced), DDP, optimizer
and LR scheduler for the new plan and moving the training state into them. The state moves in
the distributed-checkpoint format, which makes this exact: the V rows (and their Adam moments)
of a layer's fused QKV load into its new V projection, the Q/K rows into the frozen projection
(which no optimizer or DDP buffer sees), layers that moved to another pipeline stage are read by
their new owner, and everything else round-trips bit for bit. ``--epas-switch-mode memory`` (the
default) exchanges that state in memory, point to point between ranks for moved layers
(:mod:`epas_megatron.checkpointing.in_memory`); ``checkpoint`` saves it to a staging checkpoint
and loads it back. The two give bit-identical runs, and a resume is the same load, so runs
resumed before or after a switch match uninterrupted ones.

The executor works on a :class:`SwitchHost` (the trainer): it owns the training state and knows
how to plan a region, build for the plan, save and load; the executor only sequences those and
measures the event. Reporting it is :meth:`epas_megatron.training.reporting.Reporter.log_switch`'s.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Optional, Protocol

import torch.distributed as dist

from epas_megatron.checkpointing.in_memory import drop_gradients, hold_state
from epas_megatron.checkpointing.switch_adoption import SwitchAdoption
from epas_megatron.compat.megatron_fixes import release_dropped_models
from epas_megatron.runtime.distributed import ParallelDims, all_reduce_values
from epas_megatron.runtime.rng import preserved_rng_state


class SwitchHost(Protocol):
    """What a switch needs of the trainer whose training state it moves."""

    dims: ParallelDims
    model: list
    optimizer: object
    scheduler: object
    layout: Optional[str]

    def set_region(self, sharing_layers: tuple[int, ...]) -> None:
        """Make the plan of ``sharing_layers`` (and its pipeline layout) the current one."""

    def build(self, initialize: bool = True, adoption=None) -> None:
        """Model chunks, DDP, optimizer and LR schedule for the current plan (``adoption``: their
        state taken over as they are built, :class:`epas_megatron.engine.state.StateAdoption`)."""

    def save(self, root: Optional[Path] = None, keep_last: Optional[int] = None) -> Path:
        """Checkpoint the full training state under ``root``; the checkpoint's directory."""

    def load(self, checkpoint_dir: Path) -> None:
        """Load a checkpoint into the built state."""


class SwitchExecutor:
    """Carries out switches with one ``--epas-switch-mode`` and keeps their durations."""

    def __init__(self, mode: str, staging_dir: Path):
        self.mode = mode
        """``checkpoint``: through a staging checkpoint; anything else (``memory``): in memory."""
        self.staging_dir = staging_dir
        """Where ``checkpoint`` mode stages the state (removed after each switch)."""
        self.seconds: list[float] = []
        """Duration of every switch of this run so far."""

    def apply(self, host: SwitchHost, sharing_layers: tuple[int, ...]) -> dict:
        """Change ``host``'s sharing region (and pipeline layout). Returns the switch's record:
        ``seconds``, ``layout``, ``previous_layout``, ``mode``, ``bytes_written`` and, in memory,
        ``bytes_between_ranks``."""
        start = time.perf_counter()
        previous_layout = host.layout
        if self.mode == "checkpoint":
            info = self._through_checkpoint(host, tuple(sharing_layers))
        else:
            info = self._in_memory(host, tuple(sharing_layers))
        release_dropped_models()  # Megatron's caches of the old model's modules
        seconds = time.perf_counter() - start
        self.seconds.append(seconds)
        return {"seconds": seconds, "layout": host.layout, "previous_layout": previous_layout, "mode": self.mode, **info}

    def _through_checkpoint(self, host: SwitchHost, sharing_layers: tuple[int, ...]) -> dict:
        """Save the whole state to a staging checkpoint, rebuild, load it back."""
        staging, logging_rank = self.staging_dir, host.dims.is_logging_rank
        if logging_rank and staging.exists():
            shutil.rmtree(staging)
        dist.barrier()
        saved = host.save(root=staging, keep_last=0)
        written = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file()) if logging_rank else 0
        host.set_region(sharing_layers)
        host.build(initialize=False)
        host.load(saved)
        dist.barrier()
        if logging_rank:
            shutil.rmtree(staging, ignore_errors=True)
        return {"bytes_written": written}

    def _in_memory(self, host: SwitchHost, sharing_layers: tuple[int, ...]) -> dict:
        """Hold the state's tensors, release the old objects, build the new ones taking the held
        tensors over as they are built (:mod:`epas_megatron.checkpointing.in_memory`)."""
        held = hold_state(host.model, host.optimizer, host.scheduler, {})
        drop_gradients(host.model)
        host.set_region(sharing_layers)
        adoption = SwitchAdoption(held)
        del held
        with preserved_rng_state():  # building draws from it; a checkpoint load restores it
            host.build(initialize=False, adoption=adoption)
        stats = adoption.stats
        del adoption
        (moved,) = all_reduce_values([float(stats.bytes_received)])
        return {"bytes_written": 0, "bytes_between_ranks": int(moved)}
