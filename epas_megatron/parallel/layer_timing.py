"""Measured layer costs for the stage planner (``--epas-cost-model measured``).

The FLOPs model misses what is not a matmul (memory-bound elementwise work, attention kernels,
the loss), so the planner can instead use forward times measured in the running model: a
:class:`LayerTimer` hooks the decoder layers and the LM head of this rank's chunks for a few
iterations after each (re)build and records their forward wall time per kind -- ``compute``
(computing and source layers), ``share`` and ``output_layer``. :meth:`LayerTimer.measured`
averages over all ranks (an all-reduce), so every rank plans the same layout; kinds not measured
yet (e.g. sharing layers before the first switch) keep their FLOPs cost, scaled into seconds by
:func:`epas_megatron.parallel.cost_model.calibrate`. Backward costs about twice the forward for
every kind, so forward times give the right ratios. On GPU each hook synchronises the device,
which is why timing runs only for a few iterations.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

KINDS = ("compute", "share", "output_layer")


class LayerTimer:
    """Forward wall time per layer kind, accumulated by module hooks."""

    def __init__(self):
        self.sums = {kind: 0.0 for kind in KINDS}
        self.counts = {kind: 0 for kind in KINDS}
        self._handles = []
        self._started: dict[int, float] = {}

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _pre(self, module, args):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._started[id(module)] = time.perf_counter()

    def _post_for(self, kind: str):
        def post(module, args, output):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = self._started.pop(id(module), None)
            if start is not None:
                self.sums[kind] += time.perf_counter() - start
                self.counts[kind] += 1

        return post

    def attach(self, model_chunks) -> None:
        """Hook every decoder layer and the LM head of (unwrapped or DDP-wrapped) chunks."""
        from epas_megatron.model.wrapping import unwrap_model

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
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def measured(self) -> dict[str, float]:
        """Mean forward seconds per kind over every rank that measured it (collective)."""
        from epas_megatron.runtime.distributed import all_reduce_values

        totals = all_reduce_values([self.sums[k] for k in KINDS] + [float(self.counts[k]) for k in KINDS])
        return {kind: totals[i] / totals[len(KINDS) + i] for i, kind in enumerate(KINDS) if totals[len(KINDS) + i] > 0}


def calibrated_costs(flops_costs, timer: Optional[LayerTimer]):
    """FLOPs costs with the measured kinds replaced (collective when a timer is given)."""
    from epas_megatron.parallel.cost_model import calibrate

    if timer is None:
        return flops_costs
    measured = timer.measured()
    return calibrate(flops_costs, measured) if measured else flops_costs
