"""SIGTERM / SIGUSR1 (Slurm's pre-timeout signal): a checkpoint and a clean exit, agreed by every rank.

The handler only sets a flag; the training loop asks :meth:`ExitSignal.agreed` after each
iteration, which agrees across ranks with an all-reduce so that every rank saves the same
iteration. The all-reduce carries the signal number itself (the largest one received anywhere),
so every rank reports the same reason even when Slurm's signal reached the ranks in different
iterations.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch.distributed as dist

from epas_megatron.runtime.distributed import all_reduce_values


class ExitSignal:
    """The exit request of a run (see the module doc)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}

    def install(self) -> None:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self) -> Optional[int]:
        """The signal number if any rank has received one (the same on every rank), else None."""
        (signum,) = all_reduce_values([float(self.received or 0)], op=dist.ReduceOp.MAX)
        return int(signum) or None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
