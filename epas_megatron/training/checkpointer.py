"""The run's checkpoints: save (synchronous or in the background with ``--async-save``), load, and
what each one records besides the tensors.

A checkpoint holds the model, optimizer and LR-schedule state in Megatron-Core's distributed
format (:mod:`epas_megatron.checkpointing.checkpoint`), the common training state (iteration,
consumed samples, region, training time) and the run's metadata
(:func:`epas_megatron.assembly.checkpoint_meta_for_run`, with each feature's entry). A load
restores the RNG states only where the saved TP/PP/DP sizes are this world's (then they exist
rank for rank).

With ``--async-save`` one save is in flight at a time: a new save, a synchronous save (a switch's
staging checkpoint) and the end of the run first complete the one in flight; every completed
save is reported once.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from epas_megatron.assembly import checkpoint_meta_for_run
from epas_megatron.checkpointing import checkpoint as ckpt
from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.runtime.distributed import all_reduce_values
from epas_megatron.validation import ResolvedRun


class RunCheckpointer:
    """Saves and loads one run's training state (the trainer hands it the current objects)."""

    def __init__(self, run: ResolvedRun, print_fn: Callable[[str], None]):
        self.run = run
        self.root = run.checkpoint_root
        """Where the run's checkpoints go (``--save``, default ``OUTPUT_DIR/checkpoints``)."""
        self.print = print_fn
        self.async_saver = None  # with --async-save, made by start()

    def start(self) -> None:
        """Ready to save (in a process group): the background saver with ``--async-save``."""
        if self.run.cfg.checkpoint.async_save:
            self.async_saver = ckpt.AsyncCheckpointer()

    def meta(self, trainer) -> dict:
        """The ``run_meta.json`` record of ``trainer``'s current state."""
        meta = checkpoint_meta_for_run(self.run, dims=trainer.dims, plan=trainer.plan, consumed_samples=trainer.consumed_samples,
                                       tokenizer_model=trainer.data.tokenizer_path)
        # Each enabled feature writes its own record (the checkpoint's metadata does not interpret it).
        return replace(meta, features=trainer.features.checkpoint_meta(trainer.iteration)).to_dict()

    def train_state(self, trainer, train_seconds: float) -> dict:
        """The common training state; the training time is the slowest rank's (one value for all)."""
        (train_seconds,) = all_reduce_values([train_seconds], op=dist.ReduceOp.MAX)
        return {"iteration": trainer.iteration, "consumed_samples": trainer.consumed_samples,
                "sharing_layers": list(trainer.sharing_layers), "train_time_s": train_seconds}

    def save(self, trainer, train_seconds: float, root: Optional[Path] = None, keep_last: Optional[int] = None) -> Path:
        """Checkpoint ``trainer``'s state synchronously (a save in flight completes first)."""
        keep = self.run.cfg.checkpoint.keep_last if keep_last is None else keep_last
        self.finish()
        return ckpt.save_checkpoint(root or self.root, trainer.iteration, trainer.model, trainer.optimizer, trainer.scheduler,
                                    self.train_state(trainer, train_seconds), self.meta(trainer), keep_last=keep)

    def checkpoint(self, trainer, train_seconds: float) -> None:
        """The run's checkpoint of this iteration: in the background with ``--async-save``."""
        if self.async_saver is None:
            self.print(f"saved checkpoint {self.save(trainer, train_seconds)}")
            return
        self.finish()
        target = self.async_saver.save(self.root, trainer.iteration, trainer.model, trainer.optimizer, trainer.scheduler,
                                       self.train_state(trainer, train_seconds), self.meta(trainer),
                                       keep_last=self.run.cfg.checkpoint.keep_last)
        self.print(f"saving checkpoint {target} in the background")
        if os.environ.get("EPAS_TEST_KILL_DURING_ASYNC_SAVE") == str(trainer.iteration):  # fault injection (tests)
            os.kill(os.getpid(), signal.SIGKILL)

    def poll(self) -> None:
        """Report a background save that has completed (never waits)."""
        if self.async_saver is not None and self.async_saver.in_flight:
            for done in self.async_saver.poll():
                self.print(f"saved checkpoint {done}")

    def finish(self) -> None:
        """Complete the background save in flight, if any."""
        if self.async_saver is not None:
            for done in self.async_saver.finish():
                self.print(f"saved checkpoint {done}")

    def latest_iteration(self) -> Optional[int]:
        """The iteration of the run's newest complete checkpoint (None: none yet)."""
        return ckpt.latest_iteration(self.root)

    def load(self, trainer, checkpoint_dir: Path) -> dict:
        """Load ``checkpoint_dir`` into ``trainer``'s built state; returns the common training state
        with the iteration and sample count filled in from the metadata where it lacks them."""
        meta = CheckpointMeta.from_dict(ckpt.read_meta(checkpoint_dir))
        d = trainer.dims
        same_sizes = meta.parallel is not None and meta.parallel.same_sizes(d.tp, d.pp, d.dp)
        state = ckpt.load_checkpoint(checkpoint_dir, trainer.model, trainer.optimizer, trainer.scheduler, restore_rng=same_sizes)
        return {"iteration": int(state.get("iteration", meta.iteration)),
                "consumed_samples": int(state.get("consumed_samples", meta.consumed_samples)),
                "train_time_s": float(state.get("train_time_s", 0.0))}
