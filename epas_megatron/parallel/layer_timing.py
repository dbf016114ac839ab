"""Measured layer costs for the stage balancer (``--epas-cost-model measured``).

The FLOPs model misses what is not a matmul (memory-bound elementwise work, attention kernels,
the loss), so the balancer can instead use forward times measured in the running model: a
:class:`LayerTimer` hooks the decoder layers and the LM head of this rank's chunks for a few
iterations after each (re)build and records their forward time per kind -- ``compute``
(computing and source layers), ``share`` and ``output_layer``. :meth:`LayerTimer.measured`
averages over all ranks (an all-reduce), so every rank picks the same layout; kinds not measured
yet (e.g. sharing layers before the first switch) keep their FLOPs cost, scaled into seconds by
:func:`epas_megatron.parallel.cost_model.calibrate`. Backward costs about twice the forward for
every kind, so forward times give the right ratios.

**Clocks.** On CUDA the hooks record a pair of timing events on the current stream around each
forward (:class:`EventClock`) and never wait for the GPU: the times (the GPU's, between the two
points of the stream) are read back in bulk -- completed pairs without waiting once many are
outstanding, all of them (one wait) at :meth:`LayerTimer.measured`. Synchronising the device
in every hook, twice per layer, would have drained the queue the host keeps ahead of the GPU
and timed the launch overhead too. On a CPU the hooks read ``time.perf_counter`` (the forward
runs synchronously there).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

KINDS = ("compute", "share", "output_layer")


class PerfCounterClock:
    """Host wall time: exact where the forward runs synchronously (the CPU)."""

    synchronous = True
    """Records are final when made (read them at once)."""

    def start(self):
        return time.perf_counter()

    def stop(self, started):
        return started, time.perf_counter()

    def collect(self, pending, wait: bool):
        """(seconds, ...) of the finished records in ``pending`` and the records left over."""
        return [end - start for start, end in pending], []


class EventClock:
    """Device time from timing events (``torch.cuda.Event(enable_timing=True)`` by default)
    recorded on the current stream; no record waits for the device."""

    synchronous = False

    def __init__(self, event_factory: Optional[Callable[[], object]] = None):
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._free: list = []
        """Events whose times were read, for reuse."""

    def _event(self):
        return self._free.pop() if self._free else self._new_event()

    def start(self):
        event = self._event()
        event.record()
        return event

    def stop(self, started):
        end = self._event()
        end.record()
        return started, end

    def collect(self, pending, wait: bool):
        """Seconds of the finished pairs in ``pending`` (all of them, waiting for the last,
        with ``wait``), and the pairs still running. Events of one stream complete in order,
        so the finished pairs are a prefix."""
        done = len(pending)
        if wait:
            for _, end in pending:
                end.synchronize()
        else:
            done = next((i for i, (_, end) in enumerate(pending) if not end.query()), len(pending))
        seconds = [start.elapsed_time(end) / 1000.0 for start, end in pending[:done]]  # ms -> s
        for start, end in pending[:done]:
            self._free += [start, end]
        return seconds, pending[done:]


class LayerTimer:
    """Forward time per layer kind, accumulated by module hooks.

    ``clock``: :class:`EventClock` on CUDA, :class:`PerfCounterClock` elsewhere (default)."""

    collect_every = 512
    """Records outstanding before the hooks read the finished ones (without waiting)."""

    def __init__(self, clock=None):
        self.clock = clock if clock is not None else (EventClock() if torch.cuda.is_available() else PerfCounterClock())
        self.sums = {kind: 0.0 for kind in KINDS}
        """Seconds per kind of the records read so far (:meth:`collect`)."""
        self.counts = {kind: 0 for kind in KINDS}
        """Records per kind read so far."""
        self._handles = []
        self._started: dict[int, object] = {}
        self._pending: list[tuple[str, object]] = []  # (kind, clock record), in record order

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _pre(self, module, args):
        self._started[id(module)] = self.clock.start()

    def _post_for(self, kind: str):
        def post(module, args, output):
            started = self._started.pop(id(module), None)
            if started is not None:
                self._pending.append((kind, self.clock.stop(started)))
                if self.clock.synchronous or len(self._pending) >= self.collect_every:
                    self.collect(wait=False)

        return post

    def collect(self, wait: bool = True) -> None:
        """Add the finished records to :attr:`sums` / :attr:`counts` (``wait``: all of them,
        waiting for the device once)."""
        if not self._pending:
            return
        kinds = [kind for kind, _ in self._pending]
        seconds, left = self.clock.collect([record for _, record in self._pending], wait)
        for kind, value in zip(kinds, seconds):
            self.sums[kind] += value
            self.counts[kind] += 1
        self._pending = self._pending[len(seconds):]
        assert len(self._pending) == len(left)

    def attach(self, model_chunks) -> None:
        """Hook every decoder layer and the LM head of (unwrapped or DDP-wrapped) chunks."""
        from epas_megatron.runtime.wrapping import unwrap_model

        self.detach()
        for chunk in model_chunks:
            module = unwrap_model(chunk)
            for layer in module.decoder.layers:
                kind = "share" if layer.epas_mode == "share" else "compute"
                self._handles.append(layer.register_forward_pre_hook(self._pre))
                self._handles.append(layer.register_forward_hook(self._post_for(kind)))
            if getattr(module, "post_process", False):
                self._handles.append(module.output_layer.register_forward_pre_hook(self._pre))
                self._handles.append(module.output_layer.register_forward_hook(self._post_for("output_layer")))

    def detach(self) -> None:
        """Remove the hooks (records not read yet are kept for :meth:`measured`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._started.clear()

    def measured(self) -> dict[str, float]:
        """Mean forward seconds per kind over every rank that measured it (collective; reads
        every outstanding record first, one wait for the device)."""
        from epas_megatron.runtime.distributed import all_reduce_values

        self.collect(wait=True)
        totals = all_reduce_values([self.sums[k] for k in KINDS] + [float(self.counts[k]) for k in KINDS])
        return {kind: totals[i] / totals[len(KINDS) + i] for i, kind in enumerate(KINDS) if totals[len(KINDS) + i] > 0}


def calibrated_costs(flops_costs, timer: Optional[LayerTimer]):
    """FLOPs costs with the measured kinds replaced (collective when a timer is given)."""
    from epas_megatron.parallel.cost_model import calibrate

    if timer is None:
        return flops_costs
    measured = timer.measured()
    return calibrate(flops_costs, measured) if measured else flops_costs
