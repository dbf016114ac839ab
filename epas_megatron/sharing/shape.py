"""Where a model's sharing regions can lie: its region shape, one value for everything that
derives or checks a region.

Which layers a region of ``r`` sharing layers holds, and which layer is each block's source,
depend on three numbers only: the decoder's layer count, how many of the deepest layers never
share (``--epas-exclude-last``) and how many blocks the region is split into (``--epas-blocks``).
The schedule, the build plan, a checkpoint's metadata, the pipeline balancer and the region
grammar of evaluation and export all need them together; :class:`RegionShape` is that triple,
and its methods are the schedule's pure region functions
(:mod:`~epas_megatron.sharing.schedule`) bound to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.schedule import LayerMode, largest_region, layer_modes, region_layers, region_order


@dataclass(frozen=True)
class RegionShape:
    """The regions a ``num_layers``-layer model can have: ``blocks`` blocks, the deepest ending at
    layer :attr:`end`, each with a computing source before it. Validated on construction
    (a ``ConfigError`` naming the flag)."""

    num_layers: int
    """Decoder layers (``--num-layers``)."""

    exclude_last: int = 0
    """Deepest layers that never share (``--epas-exclude-last``): every region ends at layer
    ``num_layers - 1 - exclude_last``. 0 is the paper's choice (the last layer shares)."""

    blocks: int = 1
    """Sharing blocks of every region (``--epas-blocks``); 1 is the paper's single block."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1:
            raise ConfigError(f"--num-layers must be a positive integer, got {self.num_layers!r}")
        largest_region(self.num_layers, self.exclude_last, self.blocks)  # checks exclude_last and blocks

    @classmethod
    def of(cls, holder) -> RegionShape:
        """The shape of anything with ``num_layers``, ``exclude_last`` and ``blocks``: a
        :class:`~epas_megatron.sharing.schedule.SharingSchedule` (this module builds on that
        one, so the schedule has no property for it), a checkpoint's metadata."""
        return cls(holder.num_layers, holder.exclude_last, holder.blocks)

    @property
    def end(self) -> int:
        """The deepest layer any region may hold."""
        return self.num_layers - 1 - self.exclude_last

    @property
    def largest(self) -> int:
        """The most layers that can share (every block keeps its source)."""
        return largest_region(self.num_layers, self.exclude_last, self.blocks)

    def layers(self, size: int, flag: str = "--epas-target-layers", target_layers: int | None = None) -> tuple[int, ...]:
        """The region of ``size`` sharing layers, ascending (:func:`~epas_megatron.sharing.schedule.region_layers`)."""
        return region_layers(self.num_layers, size, flag, self.exclude_last, self.blocks, target_layers)

    def order(self, size: int, flag: str = "--epas-target-layers") -> tuple[int, ...]:
        """The layers of :meth:`layers` in the order they join the region
        (:func:`~epas_megatron.sharing.schedule.region_order`)."""
        return region_order(self.num_layers, size, flag, self.exclude_last, self.blocks)

    def modes(self, sharing_layers: Iterable[int], flag: str = "--epas-target-layers",
              target_layers: int | None = None) -> list[LayerMode]:
        """Every layer's mode while ``sharing_layers`` share; a ``ConfigError`` naming ``flag``
        if they are not a region of this shape (:func:`~epas_megatron.sharing.schedule.layer_modes`)."""
        return layer_modes(self.num_layers, sharing_layers, flag, self.exclude_last, self.blocks, target_layers)


def as_shape(shape: RegionShape | int) -> RegionShape:
    """``shape``, or for a layer count the shape of the paper's regions (one block that ends at
    the last layer)."""
    return shape if isinstance(shape, RegionShape) else RegionShape(shape)
