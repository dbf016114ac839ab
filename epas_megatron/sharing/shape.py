"""Where a model's sharing regions can lie: its region shape, one value for everything that
derives or checks a region.

Which layers a region of ``r`` sharing layers holds, and which layer is each block's source,
depend on three numbers only: the decoder's layer count, how many of the deepest layers never
share (``--epas-exclude-last``) and how many blocks the region is split into (``--epas-blocks``).
The schedule, the build plan, a checkpoint's metadata, the pipeline balancer and the region
grammar of evaluation and export all need them together; :class:`RegionShape` is that triple,
and this module is the region geometry: each layer's mode (:class:`LayerMode`), where a region of
a given size lies, the order its layers join it, and the checks that name the flag to change.
(The progressive schedule, :mod:`~epas_megatron.sharing.schedule`, says which size is in effect
at which iteration.)

Blocks:


* ``blocks = K`` (``--epas-blocks``, default 1: the paper's single block) splits the targets into
  ``K`` blocks of ``size = target_layers / K`` layers (``K`` must divide the target). Layers
  ``0..region_end`` (``E = region_end + 1`` of them) are cut into ``K`` spans; span ``k``
  (0-based) ends at layer ``e_k = floor((k + 1) * E / K) - 1``, and block ``k`` fills its deep
  end, layers ``e_k - size + 1 .. e_k``, with its own source ``e_k - size`` inside the span (so
  ``target_layers + K <= E``: one computing source per block). Why: each block repeats the
  paper's single-block placement within its share of the depth; the deepest block still ends at
  ``region_end`` (the last layer by default, which the paper's ablation found better); and the
  blocks are spread as evenly as the depth allows, so for the same number of sharing layers only
  the block structure differs from ``K = 1`` (the paper's "one block vs several" ablation).
* With ``K`` blocks the targets switch round-robin, deepest block first and each block deep ->
  shallow (block ``K - 1``'s deepest layer, block ``K - 2``'s, ..., block 0's, then every block's
  second deepest, ...); switch ``j`` takes the next ``growth`` layers of that order. Why: the
  blocks grow together, every region on the way has the same block structure as the final one,
  and ``K = 1`` is exactly Algorithm 1. The blocks' ends depend only on ``E`` and ``K``, so a
  region of size ``r`` is always the first ``r`` layers of one fixed order (whatever the target);
  the target only decides which sizes are reachable.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from epas_megatron.errors import ConfigError


class LayerMode(enum.StrEnum):
    """What a decoder layer does with Q/K. Members compare equal to their string values."""

    COMPUTE = "compute"
    """Computes its own Q/K; no later layer reads them."""
    SOURCE = "source"
    """Computes its own Q/K and is the last computing layer before a sharing block (the whole
    region when there is one block): every sharing layer of that block reuses its (post-RoPE)
    Q/K."""
    SHARE = "share"
    """Skips its Q/K projections and reuses its block's source layer's Q/K with its own V."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def layer_runs(layers: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive layers as ``(first, last)``, ascending."""
    runs: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


def format_layers(layers: Iterable[int]) -> str:
    """``(6, 7, 8)`` -> ``"6-8"``, ``(11,)`` -> ``"11"``, ``(3, 4, 5, 9, 11)`` -> ``"3-5, 9, 11"``,
    ``()`` -> ``"none"``."""
    return format_ranges(layer_runs(layers)) or "none"


def format_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    """``((3, 5), (9, 9))`` -> ``"3-5, 9"``; adjacent ranges stay apart."""
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def check_exclude_last(num_layers: int, exclude_last: int) -> None:
    """``exclude_last`` must leave at least one layer (the source) in a ``num_layers`` model."""
    if not is_int(exclude_last) or not 0 <= exclude_last <= num_layers - 1:
        raise ConfigError(
            f"--epas-exclude-last must be an integer between 0 and {num_layers - 1} for a "
            f"{num_layers}-layer model (the deepest layers that never share), got {exclude_last!r}"
        )


def check_blocks_value(blocks: int) -> None:
    """``--epas-blocks`` is an integer >= 1 (whether it fits the target: :func:`check_blocks`)."""
    if not is_int(blocks) or blocks < 1:
        raise ConfigError(
            f"--epas-blocks must be an integer >= 1 (the number of sharing blocks; 1 is the "
            f"paper's single block), got {blocks!r}"
        )


def check_blocks(
    num_layers: int,
    exclude_last: int,
    target: int,
    blocks: int,
    target_flag: str = "--epas-target-layers",
) -> None:
    """``target`` layers (already within ``0..region_end``) split into ``blocks`` equal blocks,
    each with a computing source before it inside its span (module docstring). ``target_flag``
    names the option that set ``target``. EPAS off (``target`` 0) takes any ``blocks``."""
    check_blocks_value(blocks)
    if blocks == 1 or target == 0:
        return
    end = num_layers - 1 - exclude_last
    depth = end + 1  # layers 0..end, cut into the blocks' spans
    # Every span holds at least floor(depth / blocks) layers, so a block of `size` layers keeps
    # its source in every span iff size + 1 <= depth // blocks, i.e. target + blocks <= depth.
    fitting = [k for k in range(1, target + 1) if target % k == 0 and target + k <= depth]
    if target % blocks:
        raise ConfigError(
            f"--epas-blocks {blocks} does not divide {target_flag} {target} (the blocks have "
            f"equal sizes); use --epas-blocks among {fitting}, or a target that is a multiple "
            f"of {blocks}"
        )
    if target + blocks > depth:
        size = target // blocks
        excluded = f" (--epas-exclude-last {exclude_last})" if exclude_last else ""
        largest_target = blocks * (depth // blocks - 1)
        other = (
            f", or at most {largest_target} {target_flag} with --epas-blocks {blocks}"
            if largest_target > 0
            else f"; no target fits {blocks} blocks here (a block and its source take at least 2 "
            f"layers, so at most {depth // 2} blocks)"
        )
        raise ConfigError(
            f"--epas-blocks {blocks} with {target_flag} {target}: each block of {size} layer(s) "
            f"needs a computing source layer before it inside its own span of layers 0-{end}"
            f"{excluded}, {blocks * (size + 1)} layers in all, but there are {depth}; "
            + (f"use --epas-blocks among {fitting} (at most {fitting[-1]})" if fitting
               else f"no --epas-blocks fits {target} layers")
            + other
        )


def place_blocks(region_end: int, target: int, blocks: int) -> tuple[tuple[int, int], ...]:
    """``(first, last)`` of each of the ``blocks`` final blocks, ascending (module docstring);
    ``()`` for an empty target. Assumes :func:`check_blocks` passed."""
    if not target:
        return ()
    size = target // blocks
    depth = region_end + 1
    ends = [(k + 1) * depth // blocks - 1 for k in range(blocks)]
    return tuple((last - size + 1, last) for last in ends)


def switching_order(block_ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Target layers in the order they switch: round-robin over the blocks, deepest block first,
    each block deep -> shallow. One block: ``region_end, region_end - 1, ...``."""
    if not block_ranges:
        return ()
    size = block_ranges[0][1] - block_ranges[0][0] + 1
    return tuple(last - depth for depth in range(size) for _, last in reversed(block_ranges))


def _resolve_target(
    num_layers: int, exclude_last: int, size: int, flag: str, target_layers: int | None, blocks: int = 1
) -> tuple[int, str]:
    """(target region size, the flag that set it) for a region of ``size`` layers. Without
    ``target_layers``: the smallest target of ``blocks`` equal blocks that holds ``size`` layers
    (``size`` itself for one block), named by ``flag`` -- the layers of a region do not depend on
    the target (module docstring), only whether it fits does."""
    if target_layers is None:
        return -(-size // blocks) * blocks, flag
    end = num_layers - 1 - exclude_last
    if not is_int(target_layers) or not 0 <= target_layers <= end:
        excluded = f" with --epas-exclude-last {exclude_last}" if exclude_last else ""
        raise ConfigError(
            f"--epas-target-layers {target_layers!r}: a target region must have between 0 and "
            f"{end} layers for a {num_layers}-layer model{excluded} (one layer before it must "
            f"remain the source)"
        )
    if size > target_layers:
        raise ConfigError(
            f"{flag}: a region of {size} sharing layers is larger than the --epas-target-layers "
            f"{target_layers} region its blocks are placed for; use at most {target_layers}"
        )
    return target_layers, "--epas-target-layers"


def largest_region(num_layers: int, exclude_last: int = 0, blocks: int = 1) -> int:
    """The most layers that can share in a ``num_layers`` model: every block keeps a computing
    source inside its span, so ``blocks * (E // blocks - 1)`` with ``E = num_layers -
    exclude_last`` (``num_layers - 1 - exclude_last`` for one block)."""
    check_exclude_last(num_layers, exclude_last)
    check_blocks_value(blocks)
    return max(0, blocks * ((num_layers - exclude_last) // blocks - 1))


def region_layers(
    num_layers: int,
    size: int,
    flag: str = "--epas-target-layers",
    exclude_last: int = 0,
    blocks: int = 1,
    target_layers: int | None = None,
) -> tuple[int, ...]:
    """The sharing region of ``size`` layers, ascending: the first ``size`` layers of the
    switching order of the ``target_layers`` target region in ``blocks`` blocks (module
    docstring). With one block it is the block that ends at layer ``num_layers - 1 -
    exclude_last`` (the deepest layers when ``exclude_last`` is 0), whatever ``target_layers`` is.

    For callers that pick a region length directly (e.g. evaluation at several region sizes).
    ``target_layers`` (the run's) only checks that ``size`` is reachable (``size <=
    target_layers``, the blocks fit); ``None`` checks that some target of equal blocks holds
    ``size`` layers. ``flag`` names the option that set ``size`` in error messages.
    """
    if not is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"--num-layers must be a positive integer, got {num_layers!r}")
    check_exclude_last(num_layers, exclude_last)
    end = num_layers - 1 - exclude_last  # the region's last layer
    if not is_int(size) or not 0 <= size <= end:
        after = (
            f" with --epas-exclude-last {exclude_last} (layer(s) "
            f"{format_layers(range(end + 1, num_layers))} never share)"
            if exclude_last
            else ""
        )
        raise ConfigError(
            f"{flag} {size!r}: a sharing region must have between 0 and {end} layers for a "
            f"{num_layers}-layer model{after} (one layer before the region must remain the source)"
        )
    check_blocks_value(blocks)
    target, target_flag = _resolve_target(num_layers, exclude_last, size, flag, target_layers, blocks)
    check_blocks(num_layers, exclude_last, target, blocks, target_flag)
    order = switching_order(place_blocks(end, target, blocks))
    return tuple(sorted(order[:size]))


def region_order(
    num_layers: int,
    size: int,
    flag: str = "--epas-target-layers",
    exclude_last: int = 0,
    blocks: int = 1,
) -> tuple[int, ...]:
    """The layers of :func:`region_layers` (same arguments) in the order they join the region
    (the switching order; one block: the deepest first): the region of any ``r <= size`` layers
    is the first ``r`` of them."""
    region = region_layers(num_layers, size, flag, exclude_last, blocks)
    target, _ = _resolve_target(num_layers, exclude_last, size, flag, None, blocks)
    order = switching_order(place_blocks(num_layers - 1 - exclude_last, target, blocks))[:size]
    assert tuple(sorted(order)) == region, (order, region)
    return tuple(order)


def layer_modes(
    num_layers: int,
    sharing_layers: Iterable[int],
    flag: str = "--epas-target-layers",
    exclude_last: int = 0,
    blocks: int = 1,
    target_layers: int | None = None,
) -> list[LayerMode]:
    """Per-layer mode (``"compute"`` / ``"source"`` / ``"share"``) for a sharing set.

    With one block, ``sharing_layers`` must be one contiguous block of 0-based layer indices
    ending at layer ``num_layers - 1 - exclude_last`` (the last layer by default) and must leave
    layer 0 computing; otherwise a ``ConfigError`` naming ``flag`` is raised. The source is the
    last computing layer before a non-empty region; layers after the region compute
    (``"compute"``); with an empty region every layer is ``"compute"``.

    With ``blocks > 1`` the set must be ``region_layers(num_layers, len(sharing_layers), ...,
    blocks=blocks, target_layers=target_layers)``; each maximal run of sharing layers has its source right before it.
    """
    if not is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"--num-layers must be a positive integer, got {num_layers!r}")
    check_exclude_last(num_layers, exclude_last)
    check_blocks_value(blocks)
    layers = list(sharing_layers)
    for layer in layers:
        if not is_int(layer) or not 0 <= layer < num_layers:
            raise ConfigError(
                f"{flag}: sharing layer {layer!r} is not a layer index of a {num_layers}-layer "
                f"model (0..{num_layers - 1})"
            )
    if len(set(layers)) != len(layers):
        raise ConfigError(f"{flag}: sharing layers {layers} contain duplicates")
    region = sorted(layers)
    end = num_layers - 1 - exclude_last  # where the region must end
    if blocks > 1:
        return _block_layer_modes(num_layers, region, flag, exclude_last, blocks, target_layers)
    if region:
        if region[-1] != end:
            if exclude_last:
                where = (
                    f"layer {end} (--epas-exclude-last {exclude_last} keeps layers "
                    f"{format_layers(range(end + 1, num_layers))} computing)"
                )
            else:
                where = f"the last layer ({end}); EPAS shares a deep block that includes the last layer"
            raise ConfigError(
                f"{flag}: the sharing region {format_layers(region)} must end at {where}; use "
                f"layers ending at {end}, or the --epas-exclude-last that makes "
                f"{region[-1]} the region's end ({num_layers - 1 - region[-1]})"
            )
        if region != list(range(region[0], end + 1)):
            raise ConfigError(
                f"{flag}: the sharing layers {format_layers(region)} are not one contiguous "
                f"block; use layers {region[0]}-{end} or a shorter block ending at {end}"
            )
        if region[0] == 0:
            raise ConfigError(
                f"{flag}: the region {format_layers(region)} starts at layer 0, leaving no "
                f"source layer before it; use at most {end} sharing layers"
            )
    if target_layers is not None:
        _resolve_target(num_layers, exclude_last, len(region), flag, target_layers)
    modes = [LayerMode.COMPUTE] * num_layers
    if region:
        modes[region[0] - 1] = LayerMode.SOURCE
        for layer in region:
            modes[layer] = LayerMode.SHARE
    return modes


def _block_layer_modes(
    num_layers: int,
    region: list[int],
    flag: str,
    exclude_last: int,
    blocks: int,
    target_layers: int | None,
) -> list[LayerMode]:
    """:func:`layer_modes` for ``blocks > 1``; ``region`` is sorted, valid indices, distinct."""
    end = num_layers - 1 - exclude_last
    if len(region) > end:
        raise ConfigError(
            f"{flag}: {len(region)} sharing layers leave no source layer in a {num_layers}-layer "
            f"model (the region ends at layer {end}); use at most {end} sharing layers"
        )
    target, target_flag = _resolve_target(num_layers, exclude_last, len(region), flag, target_layers, blocks)
    check_blocks(num_layers, exclude_last, target, blocks, target_flag)
    placed = place_blocks(end, target, blocks)
    expected = sorted(switching_order(placed)[: len(region)])
    if region != expected:
        raise ConfigError(
            f"{flag}: the sharing layers {format_layers(region)} are not a region of "
            f"--epas-blocks {blocks} (blocks {format_ranges(placed)} of the "
            f"{target}-layer target region); {len(region)} sharing layers would be "
            f"{format_layers(expected)}"
        )
    modes = [LayerMode.COMPUTE] * num_layers
    for first, last in layer_runs(region):
        # every block keeps a computing layer before it in its span, so runs never touch
        modes[first - 1] = LayerMode.SOURCE
        for layer in range(first, last + 1):
            modes[layer] = LayerMode.SHARE
    return modes


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
        :class:`~epas_megatron.sharing.schedule.SharingSchedule`, a checkpoint's metadata."""
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
        """The region of ``size`` sharing layers, ascending (:func:`region_layers`)."""
        return region_layers(self.num_layers, size, flag, self.exclude_last, self.blocks, target_layers)

    def order(self, size: int, flag: str = "--epas-target-layers") -> tuple[int, ...]:
        """The layers of :meth:`layers` in the order they join the region
        (:func:`region_order`)."""
        return region_order(self.num_layers, size, flag, self.exclude_last, self.blocks)

    def modes(self, sharing_layers: Iterable[int], flag: str = "--epas-target-layers",
              target_layers: int | None = None) -> list[LayerMode]:
        """Every layer's mode while ``sharing_layers`` share; a ``ConfigError`` naming ``flag``
        if they are not a region of this shape (:func:`layer_modes`)."""
        return layer_modes(self.num_layers, sharing_layers, flag, self.exclude_last, self.blocks, target_layers)


def as_shape(shape: RegionShape | int) -> RegionShape:
    """``shape``, or for a layer count the shape of the paper's regions (one block that ends at
    the last layer)."""
    return shape if isinstance(shape, RegionShape) else RegionShape(shape)
