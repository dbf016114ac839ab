"""The progressive sharing schedule: which decoder layers share Q/K at which iteration.

EPAS (Karim et al., "EPAS: Efficient training with Progressive Activation Sharing", Canadian AI
2026) gives a decoder layer one of two modes: it either *computes* its own Q/K or *shares*
(reuses) the post-RoPE Q/K of the last computing layer before it, the *source*. The sharing
region is one contiguous block at the deep end (``--epas-blocks`` splits it, below); by default
it includes the last layer (the paper's choice), and ``exclude_last = N``
(``--epas-exclude-last``) keeps the deepest ``N`` layers computing, so the region ends at layer
``num_layers - 1 - N`` (the paper's ablation of where the region ends). Layers are 0-based.

Algorithm 1 of the paper, in our words: with interval ``I``, target layers
``S_c`` (shallow→deep, a contiguous deep block including the last layer) and growth ``B``
(``B >= 1``, ``B`` divides ``|S_c|``), at every iteration ``t`` (counted from 1) with
``t % I == 0``, while targets remain, the deepest ``B`` remaining targets switch to sharing.
The region never shrinks; the full region is reached at ``t = I * |S_c| / B``.

Our generalisation and decisions (the paper leaves them open):

* ``first_switch`` (default ``interval``): switches happen at iterations ``first_switch``,
  ``first_switch + I``, ``first_switch + 2I``, ... With the default this is exactly Algorithm 1.
* Iterations are 1-based training steps. **A switch at iteration t happens before the training
  step of iteration t**: the region in effect for step ``t`` includes every switch at an
  iteration ``<= t``. Iteration 0 means "before any step" (e.g. a checkpoint saved at
  iteration 0) and never has a region, because ``first_switch >= 1``.
* The target set is described by its size (and ``exclude_last``) only: the ``target_layers``
  layers ending at layer ``num_layers - 1 - exclude_last``. A target count of 0 means EPAS is
  off. The region grows from its end toward shallower layers exactly as with ``exclude_last =
  0``; layers after the region (mode ``COMPUTE``) never share and compute their own Q/K.
* At least one layer must keep computing before the region (the source), so at most
  ``num_layers - 1 - exclude_last`` layers can be targets.
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

Everything here is a pure function of the configuration; the trainer asks the schedule *what*
changes at a switch and one place (model specs, freezing, optimizer, pipeline layout) carries it
out.

Why one module of ~750 lines: the layer roles, the region rules and the schedule are one
algorithm whose decisions (above) and flag-naming errors read together; a third of it is this
record and the messages.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction

from epas_megatron.errors import ConfigError

__all__ = [
    "LayerMode",
    "SharingSchedule",
    "largest_region",
    "layer_modes",
    "region_layers",
    "resolve_target_layers",
]

#: Warn when the final region is first in effect in the last ``1 / _LATE_FINAL_DENOMINATOR``
#: of training (here: the last 10%).
_LATE_FINAL_DENOMINATOR = 10

_STATE_KEYS = (
    "num_layers", "interval", "growth", "target_layers", "first_switch", "exclude_last", "blocks"
)

#: State keys that checkpoints written before the key existed lack, with the value that gives
#: those runs' behaviour (the region then included the last layer and was one block).
_STATE_DEFAULTS = {"exclude_last": 0, "blocks": 1}

#: Flag to change for each schedule field, used in error and difference messages.
_FIELD_FLAGS = {
    "num_layers": "--num-layers",
    "interval": "--epas-interval",
    "growth": "--epas-growth",
    "target_layers": "--epas-target-layers",
    "first_switch": "--epas-first-switch",
    "exclude_last": "--epas-exclude-last",
    "blocks": "--epas-blocks",
}


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _runs(layers: Iterable[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive layers as ``(first, last)``, ascending."""
    runs: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], layer)
        else:
            runs.append((layer, layer))
    return runs


def _format_layers(layers: Iterable[int]) -> str:
    """``(6, 7, 8)`` -> ``"6-8"``, ``(11,)`` -> ``"11"``, ``(3, 4, 5, 9, 11)`` -> ``"3-5, 9, 11"``,
    ``()`` -> ``"none"``."""
    return _format_ranges(_runs(layers)) or "none"


def _format_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    """``((3, 5), (9, 9))`` -> ``"3-5, 9"``; adjacent ranges stay apart."""
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in ranges)


def resolve_target_layers(target: float | int | str, num_layers: int) -> int:
    """Number of target (eventually sharing) layers from ``--epas-target-layers``.

    Accepted forms:

    * an ``int`` (or an integral string / float such as ``"6"`` or ``6.0``): that many layers;
    * a fraction in ``(0, 1)`` (float or string such as ``"0.5"``): ``floor(num_layers * f)``
      computed exactly on the decimal the user wrote (so ``0.29 * 100`` gives 29, not 28), and
      at least 1 (a positive fraction never silently turns EPAS off);
    * ``0`` (or ``"0"`` / ``0.0``): EPAS off.

    The result must leave a source layer: ``0 <= result <= num_layers - 1``.
    """
    flag = "--epas-target-layers"
    if not _is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"--num-layers must be a positive integer, got {num_layers!r}")
    if isinstance(target, bool):
        raise ConfigError(f"{flag} must be a layer count or a fraction in (0, 1), got {target!r}")
    if isinstance(target, str):
        text = target.strip()
        try:
            value = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(
                f"{flag} must be a layer count (e.g. 6) or a fraction of the layers in (0, 1) "
                f"(e.g. 0.5), got {target!r}"
            ) from None
    elif _is_int(target):
        value = Fraction(target)
    elif isinstance(target, float):
        if not math.isfinite(target):
            raise ConfigError(f"{flag} must be finite, got {target!r}")
        # str() gives the shortest decimal that round-trips: the number the user wrote.
        value = Fraction(str(target))
    else:
        raise ConfigError(
            f"{flag} must be a layer count or a fraction in (0, 1), got {type(target).__name__} "
            f"{target!r}"
        )

    if value < 0:
        raise ConfigError(f"{flag} must be >= 0 (0 turns EPAS off), got {target!r}")
    if 0 < value < 1:
        count = max(1, math.floor(value * num_layers))
    elif value.denominator == 1:
        count = int(value)
    else:
        raise ConfigError(
            f"{flag} {target!r} is neither a whole layer count nor a fraction in (0, 1)"
        )
    if count > num_layers - 1:
        raise ConfigError(
            f"{flag} {target!r} resolves to {count} of {num_layers} layers, but at least one "
            f"layer must keep computing Q/K as the source; use at most {num_layers - 1}"
        )
    return count


def _check_exclude_last(num_layers: int, exclude_last: int) -> None:
    """``exclude_last`` must leave at least one layer (the source) in a ``num_layers`` model."""
    if not _is_int(exclude_last) or not 0 <= exclude_last <= num_layers - 1:
        raise ConfigError(
            f"--epas-exclude-last must be an integer between 0 and {num_layers - 1} for a "
            f"{num_layers}-layer model (the deepest layers that never share), got {exclude_last!r}"
        )


def _check_blocks_value(blocks: int) -> None:
    """``--epas-blocks`` is an integer >= 1 (whether it fits the target: :func:`_check_blocks`)."""
    if not _is_int(blocks) or blocks < 1:
        raise ConfigError(
            f"--epas-blocks must be an integer >= 1 (the number of sharing blocks; 1 is the "
            f"paper's single block), got {blocks!r}"
        )


def _check_blocks(
    num_layers: int,
    exclude_last: int,
    target: int,
    blocks: int,
    target_flag: str = "--epas-target-layers",
) -> None:
    """``target`` layers (already within ``0..region_end``) split into ``blocks`` equal blocks,
    each with a computing source before it inside its span (module docstring). ``target_flag``
    names the option that set ``target``. EPAS off (``target`` 0) takes any ``blocks``."""
    _check_blocks_value(blocks)
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


def _place_blocks(region_end: int, target: int, blocks: int) -> tuple[tuple[int, int], ...]:
    """``(first, last)`` of each of the ``blocks`` final blocks, ascending (module docstring);
    ``()`` for an empty target. Assumes :func:`_check_blocks` passed."""
    if not target:
        return ()
    size = target // blocks
    depth = region_end + 1
    ends = [(k + 1) * depth // blocks - 1 for k in range(blocks)]
    return tuple((last - size + 1, last) for last in ends)


def _switching_order(block_ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
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
    if not _is_int(target_layers) or not 0 <= target_layers <= end:
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
    _check_exclude_last(num_layers, exclude_last)
    _check_blocks_value(blocks)
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
    if not _is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"--num-layers must be a positive integer, got {num_layers!r}")
    _check_exclude_last(num_layers, exclude_last)
    end = num_layers - 1 - exclude_last  # the region's last layer
    if not _is_int(size) or not 0 <= size <= end:
        after = (
            f" with --epas-exclude-last {exclude_last} (layer(s) "
            f"{_format_layers(range(end + 1, num_layers))} never share)"
            if exclude_last
            else ""
        )
        raise ConfigError(
            f"{flag} {size!r}: a sharing region must have between 0 and {end} layers for a "
            f"{num_layers}-layer model{after} (one layer before the region must remain the source)"
        )
    _check_blocks_value(blocks)
    target, target_flag = _resolve_target(num_layers, exclude_last, size, flag, target_layers, blocks)
    _check_blocks(num_layers, exclude_last, target, blocks, target_flag)
    order = _switching_order(_place_blocks(end, target, blocks))
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
    order = _switching_order(_place_blocks(num_layers - 1 - exclude_last, target, blocks))[:size]
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
    if not _is_int(num_layers) or num_layers < 1:
        raise ConfigError(f"--num-layers must be a positive integer, got {num_layers!r}")
    _check_exclude_last(num_layers, exclude_last)
    _check_blocks_value(blocks)
    layers = list(sharing_layers)
    for layer in layers:
        if not _is_int(layer) or not 0 <= layer < num_layers:
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
                    f"{_format_layers(range(end + 1, num_layers))} computing)"
                )
            else:
                where = f"the last layer ({end}); EPAS shares a deep block that includes the last layer"
            raise ConfigError(
                f"{flag}: the sharing region {_format_layers(region)} must end at {where}; use "
                f"layers ending at {end}, or the --epas-exclude-last that makes "
                f"{region[-1]} the region's end ({num_layers - 1 - region[-1]})"
            )
        if region != list(range(region[0], end + 1)):
            raise ConfigError(
                f"{flag}: the sharing layers {_format_layers(region)} are not one contiguous "
                f"block; use layers {region[0]}-{end} or a shorter block ending at {end}"
            )
        if region[0] == 0:
            raise ConfigError(
                f"{flag}: the region {_format_layers(region)} starts at layer 0, leaving no "
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
    _check_blocks(num_layers, exclude_last, target, blocks, target_flag)
    placed = _place_blocks(end, target, blocks)
    expected = sorted(_switching_order(placed)[: len(region)])
    if region != expected:
        raise ConfigError(
            f"{flag}: the sharing layers {_format_layers(region)} are not a region of "
            f"--epas-blocks {blocks} (blocks {_format_ranges(placed)} of the "
            f"{target}-layer target region); {len(region)} sharing layers would be "
            f"{_format_layers(expected)}"
        )
    modes = [LayerMode.COMPUTE] * num_layers
    for first, last in _runs(region):
        # every block keeps a computing layer before it in its span, so runs never touch
        modes[first - 1] = LayerMode.SOURCE
        for layer in range(first, last + 1):
            modes[layer] = LayerMode.SHARE
    return modes


@dataclass(frozen=True)
class SharingSchedule:
    """When each target layer switches from computing to sharing Q/K (Algorithm 1, generalised).

    Switch ``k`` (``k = 0, 1, ...``) happens at iteration ``first_switch + k * interval`` and
    moves the next ``growth`` targets of the switching order to sharing: the deepest ones that
    still compute with one block, round-robin over the blocks (deepest block first) with several
    (module docstring). The region in effect for the training step of iteration ``t`` includes
    every switch at an iteration ``<= t``. The deepest target is layer :attr:`region_end`
    (``num_layers - 1 - exclude_last``); the ``exclude_last`` layers after it always compute.
    """

    num_layers: int
    """Decoder layers in the model (``--num-layers``)."""
    interval: int
    """Iterations between two switches, ``I`` in the paper (``--epas-interval``, >= 1)."""
    growth: int
    """Layers that switch at each switch, ``B`` in the paper (``--epas-growth``, >= 1); must
    divide ``target_layers``."""
    target_layers: int
    """Size of the final sharing region, ``|S_c|`` in the paper: the ``target_layers`` layers
    ending at :attr:`region_end` (``--epas-target-layers``, resolved by
    :func:`resolve_target_layers`). 0 turns EPAS off; at most ``num_layers - 1 - exclude_last``
    so that a source layer remains before the region."""
    first_switch: int | None = None
    """Iteration of the first switch (``--epas-first-switch``, >= 1). ``None`` means
    ``interval`` (Algorithm 1); it is resolved to that number on construction, so two schedules
    with the same switches compare equal."""
    exclude_last: int = 0
    """Deepest layers that never share (``--epas-exclude-last``, >= 0): the region ends at layer
    ``num_layers - 1 - exclude_last``. 0 is the paper's default (the region includes the last
    layer, which its ablation found better); a positive value reproduces the ablation."""
    blocks: int = 1
    """Sharing blocks the target region is split into (``--epas-blocks``, >= 1; must divide
    ``target_layers``). 1 is the paper's single block; with ``K`` blocks each block of
    ``target_layers / K`` layers sits at the deep end of its ``1 / K`` share of layers
    ``0..region_end`` with its own source before it (:attr:`block_ranges`), so
    ``target_layers + K <= region_end + 1``. Any value is accepted when EPAS is off."""

    def __post_init__(self) -> None:
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise ConfigError(f"--num-layers must be a positive integer, got {self.num_layers!r}")
        if not _is_int(self.interval) or self.interval < 1:
            raise ConfigError(
                f"--epas-interval must be an integer >= 1 (iterations between switches), got "
                f"{self.interval!r}"
            )
        if not _is_int(self.growth) or self.growth < 1:
            raise ConfigError(
                f"--epas-growth must be an integer >= 1 (layers per switch), got {self.growth!r}"
            )
        if not _is_int(self.target_layers) or self.target_layers < 0:
            raise ConfigError(
                f"--epas-target-layers must be a layer count >= 0 (0 turns EPAS off), got "
                f"{self.target_layers!r}"
            )
        _check_exclude_last(self.num_layers, self.exclude_last)
        if self.target_layers > self.region_end:
            excluded = (
                f" with --epas-exclude-last {self.exclude_last} (the region ends at layer "
                f"{self.region_end})"
                if self.exclude_last
                else ""
            )
            raise ConfigError(
                f"--epas-target-layers {self.target_layers} leaves no source layer before the "
                f"region in a {self.num_layers}-layer model{excluded}; use at most "
                f"{self.region_end} target layers"
                + (" or a smaller --epas-exclude-last" if self.exclude_last else "")
            )
        if self.target_layers % self.growth:
            divisors = [d for d in range(1, self.target_layers + 1) if self.target_layers % d == 0]
            raise ConfigError(
                f"--epas-growth {self.growth} does not divide --epas-target-layers "
                f"{self.target_layers}; use a growth among {divisors} (or change the target)"
            )
        _check_blocks(self.num_layers, self.exclude_last, self.target_layers, self.blocks)
        if self.first_switch is None:
            object.__setattr__(self, "first_switch", self.interval)
        elif not _is_int(self.first_switch) or self.first_switch < 1:
            raise ConfigError(
                f"--epas-first-switch must be an iteration >= 1 (iterations count from 1), got "
                f"{self.first_switch!r}"
            )

    @classmethod
    def from_flags(
        cls,
        num_layers: int,
        interval: int,
        growth: int,
        target: float | int | str,
        first_switch: int | None = None,
        exclude_last: int = 0,
        blocks: int = 1,
    ) -> SharingSchedule:
        """Build from command-line values; ``target`` may be a count or a fraction (of all
        ``num_layers`` layers, whatever ``exclude_last`` is)."""
        return cls(
            num_layers=num_layers,
            interval=interval,
            growth=growth,
            target_layers=resolve_target_layers(target, num_layers),
            first_switch=first_switch,
            exclude_last=exclude_last,
            blocks=blocks,
        )

    # ------------------------------------------------------------------ the plan
    @property
    def region_end(self) -> int:
        """The region's last (deepest) layer: ``num_layers - 1 - exclude_last``."""
        return self.num_layers - 1 - self.exclude_last

    @property
    def block_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(first, last)`` layer of each final block, ascending; ``()`` when EPAS is off. One
        block: ``((region_end + 1 - target_layers, region_end),)``."""
        return _place_blocks(self.region_end, self.target_layers, self.blocks)

    @property
    def enabled(self) -> bool:
        """Whether any layer ever shares."""
        return self.target_layers > 0

    @property
    def num_switches(self) -> int:
        """How many switches the schedule has (``target_layers / growth``)."""
        return self.target_layers // self.growth

    @property
    def final_iteration(self) -> int:
        """First iteration whose step runs with the full target region; 0 when EPAS is off.

        ``first_switch + (num_switches - 1) * interval``; with the default ``first_switch``
        this is the paper's ``I * |S_c| / B``.
        """
        if not self.enabled:
            return 0
        return self.first_switch + (self.num_switches - 1) * self.interval

    def _switches_done(self, iteration: int) -> int:
        if not _is_int(iteration) or iteration < 0:
            raise ValueError(f"iteration must be an integer >= 0, got {iteration!r}")
        if not self.enabled or iteration < self.first_switch:
            return 0
        return min(self.num_switches, (iteration - self.first_switch) // self.interval + 1)

    def region_size(self, iteration: int) -> int:
        """Number of sharing layers in effect for the step of ``iteration``."""
        return self._switches_done(iteration) * self.growth

    def sharing_layers(self, iteration: int) -> tuple[int, ...]:
        """Sharing layers (ascending) in effect for the step of ``iteration``: the first
        :meth:`region_size` layers of the switching order."""
        return tuple(sorted(_switching_order(self.block_ranges)[: self.region_size(iteration)]))

    def source_layers(self, iteration: int) -> tuple[int, ...]:
        """The source of every block that shares at ``iteration`` (the computing layer right
        before the block's sharing layers), ascending; ``()`` when no layer shares."""
        return tuple(first - 1 for first, _ in _runs(self.sharing_layers(iteration)))

    def source_layer(self, iteration: int) -> int | None:
        """The last computing layer before the region, whose Q/K the region reuses; ``None``
        when no layer shares at ``iteration``. With several blocks: the deepest block's source
        (see :meth:`source_layers` for all of them)."""
        sources = self.source_layers(iteration)
        return sources[-1] if sources else None

    def layer_modes(self, iteration: int) -> list[LayerMode]:
        """Per-layer mode in effect for the step of ``iteration``."""
        return layer_modes(
            self.num_layers,
            self.sharing_layers(iteration),
            exclude_last=self.exclude_last,
            blocks=self.blocks,
            target_layers=self.target_layers,
        )

    def switch_iterations(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every switch as ``(iteration, layers that switch there, in switching order)``; one
        block: deep -> shallow."""
        order = _switching_order(self.block_ranges)
        return [
            (
                self.first_switch + k * self.interval,
                order[k * self.growth : (k + 1) * self.growth],
            )
            for k in range(self.num_switches)
        ]

    def is_switch(self, iteration: int) -> bool:
        """Whether the region grows right before the step of ``iteration``."""
        self._switches_done(iteration)  # validates iteration
        offset = iteration - self.first_switch
        return (
            self.enabled
            and offset >= 0
            and offset % self.interval == 0
            and offset // self.interval < self.num_switches
        )

    def next_switch(self, iteration: int) -> int | None:
        """First switch iteration strictly after ``iteration``; ``None`` if none is left."""
        done = self._switches_done(iteration)
        if done == self.num_switches:
            return None
        return self.first_switch + done * self.interval

    # ------------------------------------------------------------------ checks against training
    def check_against_training(self, train_iters: int) -> list[str]:
        """Check the plan fits in ``--train-iters``; return warnings, raise on errors.

        Raises ``ConfigError`` if the full target region is reached after ``train_iters``.
        Returns a warning when it is reached in the last 10% of training, i.e. when
        ``final_iteration > 0.9 * train_iters`` (the final region then trains for fewer than a
        tenth of the steps). EPAS off: no warnings.
        """
        if not _is_int(train_iters) or train_iters < 1:
            raise ConfigError(f"--train-iters must be an integer >= 1, got {train_iters!r}")
        if not self.enabled:
            return []
        final = self.final_iteration
        if final > train_iters:
            raise ConfigError(
                f"the full EPAS region ({self.target_layers} layers) is reached at iteration "
                f"{final} but --train-iters is {train_iters}; lower --epas-interval (now "
                f"{self.interval}) or --epas-first-switch (now {self.first_switch}), or raise "
                f"--epas-growth (now {self.growth})"
            )
        warnings = []
        if final * _LATE_FINAL_DENOMINATOR > (_LATE_FINAL_DENOMINATOR - 1) * train_iters:
            steps = train_iters - final + 1
            warnings.append(
                f"the full EPAS region ({self.target_layers} layers) is reached at iteration "
                f"{final}, in the last 10% of --train-iters {train_iters}: it trains for only "
                f"{steps} step(s); lower --epas-interval or raise --epas-growth to give it longer"
            )
        return warnings

    def describe(self, train_iters: int | None = None) -> str:
        """Multi-line human-readable plan, one line per switch, for printing at start."""
        if not self.enabled:
            return f"EPAS off: all {self.num_layers} layers compute their own Q/K"
        targets = _switching_order(self.block_ranges)
        # blocks are never adjacent (each keeps its source before it), so the targets' runs
        # are the blocks
        blocks = (
            f" in {self.blocks} blocks of {self.target_layers // self.blocks}, sources "
            f"{', '.join(str(first - 1) for first, _ in self.block_ranges)}"
            if self.blocks > 1
            else ""
        )
        excluded = (
            f", layer(s) {_format_layers(range(self.region_end + 1, self.num_layers))} never "
            f"share (--epas-exclude-last {self.exclude_last})"
            if self.exclude_last
            else ""
        )
        lines = [
            f"EPAS schedule: {self.num_layers} layers, target region {_format_layers(targets)} "
            f"({self.target_layers} layers{blocks}){excluded}, growth {self.growth} every "
            f"{self.interval} iteration(s) from iteration {self.first_switch}"
        ]
        width = len(str(self.final_iteration))
        for iteration, switching in self.switch_iterations():
            region = self.sharing_layers(iteration)
            sources = (
                f"source layer(s) {', '.join(map(str, self.source_layers(iteration)))}"
                if self.blocks > 1
                else f"source layer {self.source_layer(iteration)}"
            )
            lines.append(
                f"  iteration {iteration:>{width}}: layer(s) {', '.join(map(str, switching))} "
                f"switch to sharing -> region {_format_layers(region)} ({len(region)} layers), "
                f"{sources}"
            )
        final = f"full region from iteration {self.final_iteration}"
        if train_iters is not None and train_iters >= self.final_iteration:
            steps = train_iters - self.final_iteration + 1
            share = 100 * steps / train_iters
            final += f", trained for {steps} of {train_iters} steps ({share:.1f}%)"
        lines.append(final)
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, int]:
        """Plain dict of ints for checkpoints (``first_switch`` already resolved)."""
        return {key: getattr(self, key) for key in _STATE_KEYS}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, int]) -> SharingSchedule:
        """Inverse of :meth:`state_dict`; validates like the constructor. Keys added after a
        checkpoint was written (``exclude_last``, ``blocks``) take the value that reproduces that
        run."""
        state = {**_STATE_DEFAULTS, **state}
        missing = [key for key in _STATE_KEYS if key not in state]
        unknown = sorted(set(state) - set(_STATE_KEYS))
        if missing or unknown:
            raise ConfigError(
                f"checkpoint EPAS schedule state is malformed (missing {missing}, unknown "
                f"{unknown}); was it written by another version of epas-megatron?"
            )
        return cls(**{key: state[key] for key in _STATE_KEYS})

    def differences_from(self, saved: SharingSchedule) -> list[str]:
        """One line per field where this run's schedule differs from ``saved`` (typically the
        checkpoint's), naming the flag; empty when they are equal."""
        return [
            f"{_FIELD_FLAGS[f.name]}: {getattr(saved, f.name)} in the checkpoint, "
            f"{getattr(self, f.name)} in this run"
            for f in fields(self)
            if getattr(self, f.name) != getattr(saved, f.name)
        ]

    def check_resume(self, saved_state: Mapping[str, int], iteration: int) -> None:
        """Raise ``ConfigError`` unless this run's schedule equals the checkpoint's.

        ``iteration`` is the checkpoint's iteration; the message also says how the regions
        differ there, i.e. whether the change would alter the model at once.
        """
        saved = SharingSchedule.from_state_dict(saved_state)
        diffs = self.differences_from(saved)
        if not diffs:
            return
        region_note = ""
        if saved.num_layers == self.num_layers:
            here, there = self.sharing_layers(iteration), saved.sharing_layers(iteration)
            if here != there:
                region_note = (
                    f"; at iteration {iteration} the checkpoint's region is "
                    f"{_format_layers(there)} but this run's would be {_format_layers(here)}"
                )
        raise ConfigError(
            "the EPAS schedule differs from the one saved in the checkpoint ("
            + "; ".join(diffs)
            + f"){region_note}. Resume with the checkpoint's values."
        )
