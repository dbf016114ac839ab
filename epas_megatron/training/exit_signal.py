"""SIGTERM / SIGUSR1 (Slurm's pre-timeout signal): a checkpoint and a clean exit, agreed by every rank.

The handler only sets a flag. The ranks agree with an all-reduce (MAX) that carries the signal
number itself (the largest one received anywhere), so every rank reports the same reason even
when Slurm's signal reached the ranks in different iterations.

The training loop asks :meth:`ExitSignal.poll` after each iteration, and the poll never blocks
the step or synchronises the GPU: it starts the all-reduce of what this rank has received
(asynchronously, on a gloo group of host tensors -- the default group on CPU, a gloo group of
the world made at the first poll under NCCL) and returns the outcome of the one the previous
poll started, which has long completed by then. Every rank polls at the same iterations, so all
stop at the same one: the iteration after the signal's (Slurm's pre-timeout signal leaves
minutes). :meth:`agreed` is the blocking form (one all-reduce, answered now).

Why it cannot hang on NCCL: every rank makes the same all-reduces in the same order (no branch
depends on the rank or on the signal), on a gloo group of its own under NCCL, so it never queues
behind the pipeline's point-to-point on a shared stream.
"""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist

from epas_megatron.runtime.distributed import all_reduce_values


class ExitSignal:
    """The exit request of a run (see the module doc)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}
        self._pending = None  # (work, [1] fp64 host tensor) of the all-reduce in flight
        self._group = None

    def install(self) -> None:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def agreed(self) -> Optional[int]:
        """The signal number if any rank has received one (the same on every rank), else None:
        blocking, and answered now (any poll in flight is completed first)."""
        self.drain()
        (signum,) = all_reduce_values([float(self.received or 0)], op=dist.ReduceOp.MAX)
        return int(signum) or None

    def poll(self) -> Optional[int]:
        """Non-blocking agreement (see the module doc): the signal number the previous poll's
        all-reduce agreed on (None: none, or no previous poll), and a new all-reduce started.
        One process: what it has received, at once."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        agreed = self.drain()
        mine = torch.tensor([float(self.received or 0)], dtype=torch.float64)
        work = dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=self._host_group(), async_op=True)
        self._pending = (work, mine)
        return agreed

    def drain(self) -> Optional[int]:
        """Complete the all-reduce in flight (before the process groups go away); its outcome."""
        if self._pending is None:
            return None
        work, value = self._pending
        self._pending = None
        work.wait()
        return int(value.item()) or None  # a host tensor: no device synchronisation

    def _host_group(self):
        """A gloo group of the world (host tensors): the default group where it is gloo."""
        if dist.get_backend() == "gloo":
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
