"""Which sharing regions to run a model at: the region grammar of ``--eval-regions`` (during
training), ``epas-eval --regions`` and ``epas-generate --region``, as pure functions.

One EPAS-trained model serves every region length from 0 (all layers compute their own Q/K) to
the region it has been trained with. While a run trains, the quality/compute trade-off is seen
by evaluating the *same weights* at several region lengths. The user names them once, in terms
that stay meaningful while the region grows:

* an integer ``n``: the region of ``n`` sharing layers;
* ``max``: the region in training at that moment (the *current* region);
* ``half``: half of the current region, rounded down.

A region larger than the current one holds layers that never trained in sharing mode; it is
skipped (and evaluated from the evaluation at which the region has grown to it) unless
untrained regions are allowed -- which measures inference-time sharing on untrained layers, the
paper's baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.shape import RegionShape, as_shape

WORDS = ("max", "half")
"""Region names that follow the current region."""


@dataclass(frozen=True)
class RegionSpec:
    """A parsed ``--eval-regions`` value: region sizes and names, in the order given."""

    items: tuple[int | str, ...]
    """Non-negative region sizes and names from :data:`WORDS`."""

    @classmethod
    def parse(cls, text: str, flag: str = "--eval-regions") -> "RegionSpec":
        """``'0,half,max'`` -> ``RegionSpec((0, 'half', 'max'))``; ``ConfigError`` naming ``flag``."""
        items: list[int | str] = []
        for raw in str(text).split(","):
            item = raw.strip().lower()
            if item in WORDS:
                items.append(item)
            elif item.isdigit():
                items.append(int(item))
            else:
                raise ConfigError(f"{flag}: {raw.strip()!r} is not a region size (a non-negative integer), 'half' or 'max'")
        return cls(tuple(items))

    def check_limit(self, shape: RegionShape, flag: str = "--eval-regions") -> None:
        """Every integer is a region ``shape`` can have: at most :attr:`RegionShape.largest`
        sharing layers (one layer before the region -- before each of its blocks -- computes Q/K,
        and the ``exclude_last`` layers after it never share)."""
        largest = shape.largest
        for item in self.items:
            if isinstance(item, int) and item > largest:
                excluded = (f", and --epas-exclude-last {shape.exclude_last} layers after it never share"
                            if shape.exclude_last else "")
                before = f"each of its --epas-blocks {shape.blocks} blocks" if shape.blocks > 1 else "the region"
                raise ConfigError(f"{flag}: {item} sharing layers is more than this model can have: at most {largest} "
                                  f"(one layer before {before} must compute Q/K{excluded})")

    def sizes(self, current: int) -> list[int]:
        """Every item as a region size when ``current`` layers share, in the order given."""
        return [current if item == "max" else current // 2 if item == "half" else item for item in self.items]

    def resolve(self, current: int, allow_untrained: bool = False) -> tuple[list[int], list[int]]:
        """(regions to evaluate, ascending and distinct; integers skipped because they exceed the
        ``current`` region) at a moment when ``current`` layers share."""
        chosen, skipped = set(), set()
        for size in self.sizes(current):
            if size > current and not allow_untrained:
                skipped.add(size)
            else:
                chosen.add(size)
        return sorted(chosen), sorted(skipped)


def parse_regions(text: str, trained: int, shape: RegionShape | int, allow_untrained: bool, flag: str = "--regions") -> list[int]:
    """Region sizes to run a trained model at: '0,half,2,max' -> [0, trained // 2, 2, trained],
    in the order given; a ``ConfigError`` naming ``flag`` for bad or impossible values (the
    grammar of :class:`RegionSpec`), for regions ``shape`` (the checkpoint's:
    :attr:`~epas_megatron.checkpointing.metadata.CheckpointMeta.shape`; a layer count: one block
    ending at the last layer) cannot have, and for
    regions larger than the ``trained`` one unless ``allow_untrained``."""
    spec = RegionSpec.parse(text, flag)
    spec.check_limit(as_shape(shape), flag)
    regions = spec.sizes(trained)
    for r in regions:
        if r > trained and not allow_untrained:
            raise ConfigError(
                f"{flag}: {r} is larger than the region this checkpoint was trained with ({trained} layers); "
                "layers beyond it never trained in sharing mode (pass --allow-untrained-regions to measure that anyway)"
            )
    return regions
