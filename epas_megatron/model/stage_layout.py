"""The pipeline layout: which decoder layers each virtual pipeline stage holds.

Megatron-Core splits the decoder layers ``0 .. L-1`` into ``p * v`` contiguous blocks, the
*virtual stages*, for ``p`` pipeline ranks (``--pp``) and ``v`` model chunks per rank
(``--vpp``). Virtual stage ``k`` is held by pipeline rank ``k % p`` as its chunk ``k // p``
(interleaved order: ``k = vp_stage * p + pp_rank``). The embedding lives on virtual stage 0, the
output layer and loss on virtual stage ``p*v - 1``.

:class:`StageLayout` is such a split, optionally priced (a cost per virtual stage and per rank),
and converts to and from Megatron-Core's ``pipeline_model_parallel_layout`` string
(``--pipeline-model-parallel-layout`` in Megatron's own arguments), e.g. ``"Ettt|ttt|ttL"``.

:class:`VStageLayout` is the same for V placement (a V pipeline schedule): ``2p`` virtual stages
in V order, stage ``s`` on rank ``s`` and on rank ``2p-1-s``, written ``"V:Ett|t|ttt|t|tt|tL"``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from epas_megatron.errors import ConfigError
from epas_megatron.model.v_placement import even_v_stage_sizes, v_layout_string, v_stage


@dataclass(frozen=True)
class StageLayout:
    """A split of decoder layers ``0 .. num_layers-1`` into ``p * v`` contiguous virtual stages.

    Virtual stage ``k = vp_stage * p + pp_rank`` holds the ``k``-th block (Megatron-Core's
    interleaved order); the embedding is on virtual stage 0 and the output layer and loss on the
    last one.
    """

    stage_sizes: tuple[int, ...]
    """Decoder layers per virtual stage, in virtual-stage order (length ``p * v``)."""

    pipeline_parallel_size: int
    """``p`` (``--pp``)."""

    virtual_pipeline_parallel_size: int = 1
    """``v`` (``--vpp``): model chunks per pipeline rank."""

    virtual_stage_costs: tuple[float, ...] | None = None
    """Predicted cost per virtual stage (its decoder layers, the embedding on the first, the
    output layer + loss on the last, and its share of the pipeline boundaries' cost), or None
    for a layout without costs."""

    rank_costs: tuple[float, ...] | None = None
    """Predicted cost per pipeline rank (physical stage): the sum of its virtual stages."""

    optimal: bool = True
    """False only when the balancer ran out of its work budget before proving the bottleneck
    minimal (see :mod:`epas_megatron.parallel.partition`); the layout is valid either way."""

    def __post_init__(self):
        p, v = self.pipeline_parallel_size, self.virtual_pipeline_parallel_size
        if p < 1 or v < 1:
            raise ValueError(f"StageLayout: p and v must be >= 1, got p={p}, v={v}")
        if len(self.stage_sizes) != p * v:
            raise ValueError(
                f"StageLayout: {len(self.stage_sizes)} stage sizes for p={p} x v={v} = {p * v} "
                "virtual stages"
            )
        if any(size < 0 for size in self.stage_sizes):
            raise ValueError(f"StageLayout: negative stage size in {self.stage_sizes}")
        if self.virtual_stage_costs is not None and len(self.virtual_stage_costs) != p * v:
            raise ValueError("StageLayout: virtual_stage_costs needs one entry per virtual stage")
        if self.rank_costs is not None and len(self.rank_costs) != p:
            raise ValueError("StageLayout: rank_costs needs one entry per pipeline rank")

    # ---- construction

    @classmethod
    def from_sizes(
        cls,
        stage_sizes: Sequence[int],
        pipeline_parallel_size: int,
        virtual_pipeline_parallel_size: int = 1,
        costs: Sequence[float] | None = None,
        embedding_cost: float = 0.0,
        output_cost: float = 0.0,
        boundary_cost: float = 0.0,
    ) -> StageLayout:
        """A layout with the given per-virtual-stage sizes, priced when ``costs`` (one per
        decoder layer) are given. ``boundary_cost`` is charged to both virtual stages at every
        boundary between consecutive virtual stages (the balancer passes the Q/K hand-off's p2p
        cost here when the layout needs it; see :mod:`epas_megatron.parallel.balancer`)."""
        sizes = tuple(int(size) for size in stage_sizes)
        p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
        if costs is None:
            return cls(sizes, p, v)
        if len(costs) != sum(sizes):
            raise ValueError(f"StageLayout: {len(costs)} layer costs for {sum(sizes)} layers")
        bounds = [0, *itertools.accumulate(sizes)]
        last = len(sizes) - 1
        stage_costs = [
            math.fsum(costs[start:end]) + boundary_cost * ((k > 0) + (k < last))
            for k, (start, end) in enumerate(zip(bounds, bounds[1:]))
        ]
        stage_costs[0] += embedding_cost
        stage_costs[-1] += output_cost
        rank_costs = tuple(math.fsum(stage_costs[r::p]) for r in range(p))
        return cls(sizes, p, v, tuple(stage_costs), rank_costs)

    @classmethod
    def even(
        cls,
        num_layers: int,
        pipeline_parallel_size: int,
        virtual_pipeline_parallel_size: int = 1,
        costs: Sequence[float] | None = None,
        embedding_cost: float = 0.0,
        output_cost: float = 0.0,
        boundary_cost: float = 0.0,
    ) -> StageLayout:
        """Megatron's default split: ``num_layers / (p*v)`` layers per virtual stage. When that
        does not divide (Megatron would refuse), the first ``num_layers % (p*v)`` virtual stages
        get one layer more."""
        p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
        base, extra = divmod(num_layers, p * v)
        sizes = [base + (k < extra) for k in range(p * v)]
        return cls.from_sizes(sizes, p, v, costs, embedding_cost, output_cost, boundary_cost)

    @classmethod
    def from_layout_string(cls, layout: str, pipeline_parallel_size: int) -> StageLayout:
        """Parse a ``pipeline_model_parallel_layout`` string (Megatron-Core's syntax, parsed by
        Megatron-Core) holding decoder layers, one ``E`` at the start and one ``L`` at the end.
        The result has no costs."""
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

        if not isinstance(pipeline_parallel_size, int) or pipeline_parallel_size < 1:
            raise ConfigError(f"--pp must be an integer >= 1, got {pipeline_parallel_size!r}")
        try:
            stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
        except AssertionError as error:
            raise ConfigError(f"--pipeline-layout {layout!r}: {error}") from None
        names = [[layer.name for layer in stage] for stage in stages]
        if len(names) % pipeline_parallel_size:
            raise ConfigError(
                f"--pipeline-layout {layout!r} has {len(names)} stages, which --pp "
                f"{pipeline_parallel_size} does not divide"
            )
        flat = [name for stage in names for name in stage]
        if (
            flat[:1] != ["embedding"]
            or names[0][:1] != ["embedding"]
            or flat[-1:] != ["loss"]
            or names[-1][-1:] != ["loss"]
            or flat.count("embedding") != 1
            or flat.count("loss") != 1
            or any(name not in ("embedding", "loss", "decoder") for name in flat)
        ):
            raise ConfigError(
                f"--pipeline-layout {layout!r}: expected 'E' opening the first stage, 'L' "
                "closing the last, and only decoder layers 't' otherwise"
            )
        sizes = [stage.count("decoder") for stage in names]
        return cls(tuple(sizes), pipeline_parallel_size, len(names) // pipeline_parallel_size)

    # ---- queries

    @property
    def num_layers(self) -> int:
        return sum(self.stage_sizes)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.stage_sizes)

    @property
    def bottleneck(self) -> float:
        """The slowest pipeline rank's predicted cost (needs costs)."""
        if self.rank_costs is None:
            raise ValueError("StageLayout.bottleneck: this layout has no costs")
        return max(self.rank_costs)

    def virtual_stage(self, pp_rank: int, vp_stage: int = 0) -> int:
        """Index ``k`` of the block held by ``pp_rank`` as chunk ``vp_stage``."""
        p, v = self.pipeline_parallel_size, self.virtual_pipeline_parallel_size
        if not (0 <= pp_rank < p and 0 <= vp_stage < v):
            raise IndexError(f"no (pp_rank={pp_rank}, vp_stage={vp_stage}) for p={p}, v={v}")
        return vp_stage * p + pp_rank

    def layer_range(self, pp_rank: int, vp_stage: int = 0) -> range:
        """Global decoder-layer indices (0-based) held by ``pp_rank``'s chunk ``vp_stage``."""
        k = self.virtual_stage(pp_rank, vp_stage)
        start = sum(self.stage_sizes[:k])
        return range(start, start + self.stage_sizes[k])

    def layer_ids(self, pp_rank: int, vp_stage: int = 0) -> list[int]:
        """As Megatron-Core's ``PipelineParallelLayerLayout.get_layer_id_list``."""
        return list(self.layer_range(pp_rank, vp_stage))

    def to_layout_string(self, compact: bool = False) -> str:
        """Megatron-Core's ``pipeline_model_parallel_layout`` string for this layout.

        Virtual stages in order ``k = 0 .. p*v-1`` joined by ``|``; ``E`` (embedding) opens
        stage 0, ``L`` (output layer + loss) closes the last one, one ``t`` per decoder layer.
        An empty stage is an empty string between two ``|``. With ``compact=True`` runs use
        Megatron's multiplication syntax (``t*4``, ``(t*4|)*6``), which it unrolls on parsing.
        """
        texts = []
        last = self.num_virtual_stages - 1
        for k, size in enumerate(self.stage_sizes):
            body = f"t*{size}" if compact and size > 3 else "t" * size
            texts.append(("E" if k == 0 else "") + body + ("L" if k == last else ""))
        if not compact:
            return "|".join(texts)
        # Fold runs of equal stages (never the first or last, which carry E/L): "(t*4|)*6,".
        parts, k = [], 0
        while k < len(texts):
            run = 1
            while 0 < k and k + run < last and texts[k + run] == texts[k]:
                run += 1
            if run > 1:
                parts.append(f"({texts[k]}|)*{run},")
            else:
                parts.append(texts[k] + ("|" if k < last else ""))
            k += run
        return "".join(parts)


@dataclass(frozen=True)
class VStageLayout:
    """A split of decoder layers ``0 .. num_layers-1`` into the ``2p`` contiguous virtual stages
    of V placement (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024):
    stage ``s`` is held by rank ``s`` (its chunk 0) going down and by rank ``2p-1-s`` (its chunk
    1) coming back up (:mod:`epas_megatron.model.v_placement`), so rank 0 holds the embedding
    (stage 0) and the output layer and loss (stage ``2p-1``), and rank ``p-1`` hands stage
    ``p-1`` to stage ``p`` locally (the *turn*). The counterpart of :class:`StageLayout` for a
    V schedule; a :class:`~epas_megatron.model.build_plan.BuildPlan` carries its sizes
    (``v_stage_sizes``)."""

    stage_sizes: tuple[int, ...]
    """Decoder layers per V stage, in V stage order ``0 .. 2p-1`` (layer order)."""

    pipeline_parallel_size: int
    """``p`` (``--pp``)."""

    virtual_stage_costs: tuple[float, ...] | None = None
    """Predicted cost per V stage (its decoder layers, the embedding on stage 0, the output layer
    and loss on stage ``2p-1``, its share of the pipeline boundaries' cost), or None."""

    rank_costs: tuple[float, ...] | None = None
    """Predicted cost per pipeline rank: its two stages, ``r`` and ``2p-1-r``."""

    optimal: bool = True
    """False only when the balancer ran out of its work budget (see :class:`StageLayout`)."""

    virtual_pipeline_parallel_size = 2
    """Two chunks per rank (a class constant, read as :class:`StageLayout`'s field is)."""

    def __post_init__(self):
        p = self.pipeline_parallel_size
        if p < 2:
            raise ValueError(f"VStageLayout: V placement needs p >= 2, got p={p}")
        if len(self.stage_sizes) != 2 * p:
            raise ValueError(f"VStageLayout: {len(self.stage_sizes)} stage sizes for 2 x p = {2 * p} V stages")
        if any(size < 0 for size in self.stage_sizes):
            raise ValueError(f"VStageLayout: negative stage size in {self.stage_sizes}")
        if self.virtual_stage_costs is not None and len(self.virtual_stage_costs) != 2 * p:
            raise ValueError("VStageLayout: virtual_stage_costs needs one entry per V stage")
        if self.rank_costs is not None and len(self.rank_costs) != p:
            raise ValueError("VStageLayout: rank_costs needs one entry per pipeline rank")

    @staticmethod
    def p2p_boundary(stage: int, pipeline_parallel_size: int) -> bool:
        """Whether the boundary just before V ``stage`` (``1 .. 2p-1``) is a point-to-point send
        between two ranks; the turn (before stage ``p``) is handed on within rank ``p-1``."""
        return 0 < stage < 2 * pipeline_parallel_size and stage != pipeline_parallel_size

    @classmethod
    def from_sizes(
        cls,
        stage_sizes: Sequence[int],
        pipeline_parallel_size: int,
        costs: Sequence[float] | None = None,
        embedding_cost: float = 0.0,
        output_cost: float = 0.0,
        boundary_cost: float = 0.0,
    ) -> VStageLayout:
        """A layout with the given V stage sizes, priced when ``costs`` (one per decoder layer)
        are given: ``boundary_cost`` is charged to both stages at every point-to-point boundary
        (every boundary but the turn, :meth:`p2p_boundary`)."""
        sizes, p = tuple(int(size) for size in stage_sizes), pipeline_parallel_size
        if costs is None:
            return cls(sizes, p)
        if len(costs) != sum(sizes):
            raise ValueError(f"VStageLayout: {len(costs)} layer costs for {sum(sizes)} layers")
        bounds = [0, *itertools.accumulate(sizes)]
        stage_costs = [
            math.fsum(costs[start:end])
            + boundary_cost * (cls.p2p_boundary(k, p) + cls.p2p_boundary(k + 1, p))
            for k, (start, end) in enumerate(zip(bounds, bounds[1:]))
        ]
        stage_costs[0] += embedding_cost
        stage_costs[-1] += output_cost
        rank_costs = tuple(stage_costs[r] + stage_costs[2 * p - 1 - r] for r in range(p))
        return cls(sizes, p, tuple(stage_costs), rank_costs)

    @classmethod
    def even(cls, num_layers: int, pipeline_parallel_size: int, costs: Sequence[float] | None = None,
             embedding_cost: float = 0.0, output_cost: float = 0.0, boundary_cost: float = 0.0) -> VStageLayout:
        """The even V split (:func:`~epas_megatron.model.v_placement.even_v_stage_sizes`)."""
        sizes = even_v_stage_sizes(num_layers, pipeline_parallel_size)
        return cls.from_sizes(sizes, pipeline_parallel_size, costs, embedding_cost, output_cost, boundary_cost)

    @classmethod
    def from_layout_string(cls, layout: str, pipeline_parallel_size: int, num_layers: int) -> VStageLayout:
        """Parse a V layout string (:meth:`to_layout_string`'s syntax: ``"V:"``, then the ``2p``
        stages in V order joined by ``|``, ``E`` opening stage 0, ``L`` closing stage ``2p-1``,
        ``t`` per decoder layer, Megatron-Core's ``t*n`` and ``(...)*n`` unrolled), refused with a
        ``ConfigError`` naming ``--pipeline-layout`` unless it splits ``num_layers`` layers over
        ``2 x pipeline_parallel_size`` stages of at least one layer each."""
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        p, flag = pipeline_parallel_size, f"--pipeline-layout {layout!r}"
        example = VStageLayout.even(max(num_layers, 2 * p), p).to_layout_string() if p >= 2 else "V:Et|t|t|tL"
        if not layout.startswith("V:"):
            raise ConfigError(f"{flag}: a V pipeline schedule takes a V layout, 'V:' and its 2 x --pp stages in V order "
                              f"(stage s on rank s and on rank 2p-1-s), e.g. {example}")
        try:
            stages = PipelineParallelLayerLayout.parse_str_to_list(layout[2:])
        except AssertionError as error:
            raise ConfigError(f"{flag}: {error}") from None
        names = [[layer.name for layer in stage] for stage in stages]
        if len(names) != 2 * p:
            raise ConfigError(f"{flag} has {len(names)} stages; V placement over --pp {p} has 2 x {p} = {2 * p} "
                              f"(stage s on rank s and on rank 2p-1-s), e.g. {example}")
        flat = [name for stage in names for name in stage]
        if (names[0][:1] != ["embedding"] or names[-1][-1:] != ["loss"] or flat.count("embedding") != 1
                or flat.count("loss") != 1 or any(name not in ("embedding", "loss", "decoder") for name in flat)):
            raise ConfigError(f"{flag}: expected 'E' opening the first stage, 'L' closing the last (stage {2 * p - 1}, on "
                              f"rank 0), and only decoder layers 't' otherwise, e.g. {example}")
        sizes = [stage.count("decoder") for stage in names]
        empty = [s for s, size in enumerate(sizes) if size == 0]
        if empty:
            which = f"V stages {', '.join(map(str, empty))} hold" if len(empty) > 1 else f"V stage {empty[0]} holds"
            raise ConfigError(f"{flag}: {which} no decoder layer; every V stage needs at least one")
        if sum(sizes) != num_layers:
            raise ConfigError(f"{flag} holds {sum(sizes)} decoder layers, but --num-layers is {num_layers}")
        return cls(tuple(sizes), p)

    @property
    def num_layers(self) -> int:
        return sum(self.stage_sizes)

    @property
    def num_virtual_stages(self) -> int:
        return len(self.stage_sizes)

    @property
    def bottleneck(self) -> float:
        """The slowest pipeline rank's predicted cost (needs costs)."""
        if self.rank_costs is None:
            raise ValueError("VStageLayout.bottleneck: this layout has no costs")
        return max(self.rank_costs)

    def virtual_stage(self, pp_rank: int, vp_stage: int = 0) -> int:
        """The V stage held by ``pp_rank``'s chunk ``vp_stage``: ``r`` or ``2p-1-r``."""
        p = self.pipeline_parallel_size
        if not (0 <= pp_rank < p and vp_stage in (0, 1)):
            raise IndexError(f"no (pp_rank={pp_rank}, vp_stage={vp_stage}) for p={p} under V placement")
        return v_stage(pp_rank, vp_stage, p)

    def layer_range(self, pp_rank: int, vp_stage: int = 0) -> range:
        """Global decoder-layer indices held by ``pp_rank``'s chunk ``vp_stage``."""
        k = self.virtual_stage(pp_rank, vp_stage)
        start = sum(self.stage_sizes[:k])
        return range(start, start + self.stage_sizes[k])

    def layer_ids(self, pp_rank: int, vp_stage: int = 0) -> list[int]:
        return list(self.layer_range(pp_rank, vp_stage))

    def to_layout_string(self, compact: bool = False) -> str:
        """``"V:Ett|t|ttt|t|tt|tL"``: :func:`~epas_megatron.model.v_placement.v_layout_string`
        (what ``--pipeline-layout`` takes under a V schedule)."""
        return v_layout_string(self.stage_sizes, compact)
