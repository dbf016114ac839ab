"""Per-layer cost model for pipeline-stage balancing.

A pipeline stage's time per microbatch is (to first order) the sum of the costs of what it holds:
its decoder layers, plus the embedding on the first stage and the output layer and loss on the
last. Under EPAS a decoder layer is in one of three modes (:class:`LayerMode`):

- ``COMPUTE``: an ordinary layer, computing its own Q, K and V;
- ``SOURCE``: computes its Q/K like an ordinary layer and hands them on (same cost as compute);
- ``SHARE``: reuses the source's Q/K and skips its own Q/K projections (cheaper).

One cost is not a layer's: the Q/K hand-off between pipeline stages. While a stage boundary lies
inside the sharing region or at its start (the layer after the boundary shares, so the source's
Q/K have to travel), the hand-off rides in the p2p tensor as ``r`` extra rows next to the ``s``
rows of hidden states (about ``2 s`` for MHA; :func:`epas_megatron.sharing.handoff.extra_p2p_rows`),
and since Megatron's schedules use one p2p shape, *every* boundary then sends ``s + r`` rows
(:func:`epas_megatron.model.builder.pipeline_handoff_rows`). :attr:`LayerCosts.handoff_p2p` prices
those extra rows per boundary; the balancer charges it to both ranks at every boundary of a layout
that crosses the region, and nothing otherwise. Assumptions: p2p transfers are not overlapped
with compute (Megatron's default 1F1B), each of the two ranks at a boundary is busy for the whole
transfer, and the sender's copy packing the buffer (at memory speed, some 30x the link speed) is
neglected. The hidden states' own ``s`` rows are the same for every layout and are left out.

The costs are relative numbers in any one unit: analytic FLOPs (from the FLOPs module; no
formulas live here) or measured seconds (see :func:`calibrate`). Only their ratios matter to the
balancer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.shape import LayerMode

P2P_FLOPS_PER_BYTE = 4000.0
"""FLOPs a GPU computes in the time it sends one byte to its pipeline neighbour, used to put p2p
bytes into FLOP units: about 400 TFLOP/s achieved (40% of an H100's bf16 peak) over about
100 GB/s achieved p2p bandwidth -- between NVLink within a node (several hundred GB/s) and one
400 Gb/s InfiniBand NIC per GPU between nodes (about 45 GB/s). Good to a factor of 2-3 either
way; it only matters through :attr:`LayerCosts.handoff_p2p`."""


@dataclass(frozen=True)
class LayerCosts:
    """Relative cost of each kind of piece a pipeline stage can hold (per microbatch,
    forward + backward), all in one unit."""

    compute_layer: float
    """A decoder layer that computes its own Q/K (modes ``COMPUTE`` and ``SOURCE``)."""

    share_layer: float
    """A decoder layer in sharing mode: no Q/K projections of its own."""

    embedding: float
    """The input embedding, charged to the first virtual stage of pipeline rank 0."""

    output_layer: float
    """The output projection and the loss, charged to the last virtual stage of the last
    pipeline rank."""

    handoff_p2p: float = 0.0
    """The extra time each of the two ranks at one pipeline boundary spends per microbatch
    (activations forward, gradients back) on the hand-off's extra p2p rows, charged to every
    boundary while any boundary lies inside the sharing region or at its start (see the module
    docstring). 0 leaves p2p traffic out of the plan."""

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(
                    f"LayerCosts.{field.name} must be a finite number >= 0, got {value!r}"
                )

    def for_mode(self, mode: LayerMode | str) -> float:
        """The cost of one decoder layer in ``mode``."""
        if mode in (LayerMode.COMPUTE, LayerMode.SOURCE):
            return self.compute_layer
        if mode == LayerMode.SHARE:
            return self.share_layer
        raise ValueError(
            f"unknown layer mode {mode!r}; expected one of {[str(m) for m in LayerMode]}"
        )


def costs_for_modes(layer_costs: LayerCosts, modes: Sequence[LayerMode | str]) -> list[float]:
    """Per-decoder-layer costs for a model whose layer ``i`` is in mode ``modes[i]`` (e.g. from
    :func:`epas_megatron.sharing.shape.layer_modes`).

    ``SOURCE`` layers cost the same as ``COMPUTE`` layers: they still run their Q/K projections
    (within a stage the hand-off to the sharing layers is a reference, not extra work).
    """
    return [layer_costs.for_mode(mode) for mode in modes]


def calibrate(layer_costs: LayerCosts, measured: Mapping[str, float]) -> LayerCosts:
    """Put ``layer_costs`` into the unit of ``measured`` and replace the kinds that were measured.

    ``measured`` maps some of the :class:`LayerCosts` field names (``"compute_layer"``,
    ``"share_layer"``, ``"embedding"``, ``"output_layer"``, ``"handoff_p2p"``) to measured times
    (e.g. seconds per microbatch, forward + backward). The mode names ``"compute"`` and
    ``"share"`` are accepted as aliases of ``"compute_layer"`` and ``"share_layer"``.

    Measured kinds take their measured value. Kinds that were not measured are scaled by one
    factor, ``sum(measured values) / sum(model values of the measured kinds)``: the cost-weighted
    ratio of measurement to model, so that e.g. measuring only the two decoder-layer kinds also
    converts the analytic embedding and output-layer costs into seconds. With one measured kind
    this is simply its ratio. An unmeasured ``handoff_p2p`` scales with the rest, which keeps the
    assumed ratio of p2p to compute speed (:data:`P2P_FLOPS_PER_BYTE`).

    Example: FLOPs ``LayerCosts(10, 8, 1, 3)`` and ``measured={"compute_layer": 0.020,
    "share_layer": 0.017}`` give ``LayerCosts(0.020, 0.017, 0.00205..., 0.00616...)`` (scale
    ``0.037 / 18``).
    """
    aliases = {"compute": "compute_layer", "share": "share_layer"}
    names = {field.name for field in dataclasses.fields(LayerCosts)}
    replaced: dict[str, float] = {}
    for key, value in measured.items():
        name = aliases.get(key, key)
        if name not in names:
            raise ValueError(
                f"calibrate: unknown cost kind {key!r}; expected some of {sorted(names)}"
            )
        if name in replaced:
            raise ValueError(f"calibrate: {name!r} measured twice (as {key!r} and an alias)")
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"calibrate: measured {key!r} must be a finite number > 0, got {value!r}")
        replaced[name] = float(value)
    if not replaced:
        raise ValueError("calibrate: nothing measured")

    model_sum = sum(getattr(layer_costs, name) for name in replaced)
    if model_sum <= 0:
        raise ValueError(
            f"calibrate: the model costs of the measured kinds {sorted(replaced)} are all 0, "
            "so there is no scale to carry over to the other kinds"
        )
    scale = sum(replaced.values()) / model_sum
    values = {
        name: replaced.get(name, getattr(layer_costs, name) * scale) for name in sorted(names)
    }
    return LayerCosts(**values)
