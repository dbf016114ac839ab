"""Pipeline-stage balancer: where each decoder layer lives, chosen again at every EPAS switch.

All chunks of one pipeline rank run on the same GPU, so a rank's time per microbatch is the sum
of its chunks' costs, and the pipeline runs at the pace of its slowest rank. :func:`balance_layout`
picks the split of the decoder layers into virtual stages (a
:class:`~epas_megatron.model.stage_layout.StageLayout`) that minimises that slowest rank's cost, the
*bottleneck*, priced by the cost model (:mod:`epas_megatron.parallel.cost_model`):

- every decoder layer by its mode, the embedding on virtual stage 0, the output layer and loss on
  the last one;
- the Q/K hand-off: a layout with a stage boundary just before a sharing layer sends the source's
  Q/K through the pipeline, and then every boundary's p2p tensor grows (Megatron uses one p2p
  shape), so every boundary costs ``handoff_cost`` more to each of the two virtual stages at it.
  A layout avoids that only by keeping the source and the whole sharing region in one virtual
  stage (the last one when the region includes the last layer; with ``--epas-exclude-last`` a
  boundary after the region, before the computing layers that follow it, carries no hand-off).
  :func:`balance_layout` prices both ways (region kept together, or crossing and paying at every
  boundary) and takes the faster; on a tie the one without hand-off traffic.

The search is :func:`epas_megatron.parallel.partition.best_split` (exact, ties toward Megatron's
even split; see there).

Under V placement (a V pipeline schedule; Qi et al., "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024) :func:`balance_v_layout` does the same for the ``2p`` V stages (a
:class:`~epas_megatron.model.stage_layout.VStageLayout`): each rank holds a shallow stage ``r`` and a
deep one ``2p-1-r``, rank 0 also the embedding, the LM head and the loss; the hand-off is priced
as above at every point-to-point boundary, the turn on rank ``p-1`` (a local hand-on) excepted.

:func:`balance_region` and :func:`balance_v_region` balance a sharing region from
:class:`~epas_megatron.parallel.cost_model.LayerCosts`; reports and speed-up predictions are in
:mod:`epas_megatron.parallel.layout_report`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from epas_megatron.errors import ConfigError
from epas_megatron.model.stage_layout import StageLayout, VStageLayout
from epas_megatron.parallel.cost_model import LayerCosts, costs_for_modes
from epas_megatron.parallel.partition import REL_TOL, best_split
from epas_megatron.sharing.shape import LayerMode, RegionShape, as_shape

__all__ = ["StageLayout", "VStageLayout", "crosses_region", "balance_layout", "balance_region", "priced_layout",
           "balance_v_layout", "balance_v_region", "priced_v_layout"]


def crosses_region(stage_sizes: Sequence[int], modes: Sequence[LayerMode] | None) -> bool:
    """Whether a boundary between virtual stages lies just before a sharing layer, i.e. inside
    the sharing region or at its start: the source's Q/K then travel through the pipeline."""
    if modes is None:
        return False
    return any(
        0 < end < len(modes) and modes[end] == LayerMode.SHARE
        for end in itertools.accumulate(stage_sizes)
    )


def priced_layout(
    stage_sizes: Sequence[int],
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int,
    costs: Sequence[float],
    *,
    embedding_cost: float = 0.0,
    output_cost: float = 0.0,
    modes: Sequence[LayerMode] | None = None,
    handoff_cost: float = 0.0,
) -> StageLayout:
    """A layout of the given sizes with its costs, the hand-off charged to every boundary when
    the layout crosses the sharing region (see the module docstring)."""
    boundary_cost = handoff_cost if crosses_region(stage_sizes, modes) else 0.0
    return StageLayout.from_sizes(
        stage_sizes,
        pipeline_parallel_size,
        virtual_pipeline_parallel_size,
        costs,
        embedding_cost,
        output_cost,
        boundary_cost,
    )


def balance_layout(
    costs: Sequence[float],
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    *,
    embedding_cost: float = 0.0,
    output_cost: float = 0.0,
    modes: Sequence[LayerMode] | None = None,
    handoff_cost: float = 0.0,
    fits=None,
) -> StageLayout:
    """The split of decoder layers over ``p`` ranks x ``v`` chunks with the cheapest slowest rank.

    Args:
        costs: cost of each decoder layer, in layer order (see ``cost_model``).
        pipeline_parallel_size: ``p``, pipeline ranks (``--pp``).
        virtual_pipeline_parallel_size: ``v``, model chunks per rank (``--vpp``).
        embedding_cost: charged to virtual stage 0 (pipeline rank 0, chunk 0).
        output_cost: output layer + loss, charged to the last chunk of the last rank.
        modes: the layers' modes; a boundary just before a ``SHARE`` layer carries the hand-off.
        handoff_cost: charged to both virtual stages at every boundary of a layout that has such
            a boundary (``LayerCosts.handoff_p2p``).
        fits: ``fits(rank, starts, ends)``: only layouts whose every rank passes it (a memory
            budget, :class:`~epas_megatron.parallel.memory_budget.MemoryLimit`); a
            ``ConfigError`` when none does.

    Every virtual stage holds at least one layer. Ties (bottlenecks within 1e-9 of the total
    cost): no hand-off traffic, then stage ends nearest the even split, then fewer layers on
    early ranks. ``optimal`` is False on the result only when the search ran out of its work
    budget (possible for ``p <= 4`` with ``v >= 3``).
    """
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
    costs = [float(cost) for cost in costs]
    _check_shape(len(costs), p, v)

    def price(sizes):
        return priced_layout(sizes, p, v, costs, embedding_cost=embedding_cost, output_cost=output_cost, modes=modes,
                             handoff_cost=handoff_cost)

    return _balanced(costs, p, v, "interleaved", price, embedding_cost=embedding_cost, output_cost=output_cost,
                     modes=modes, handoff_cost=handoff_cost, fits=fits, who="balance_layout")


def priced_v_layout(
    stage_sizes: Sequence[int],
    pipeline_parallel_size: int,
    costs: Sequence[float],
    *,
    embedding_cost: float = 0.0,
    output_cost: float = 0.0,
    modes: Sequence[LayerMode] | None = None,
    handoff_cost: float = 0.0,
) -> VStageLayout:
    """A V layout of the given sizes with its costs: the hand-off charged to both sides of every
    point-to-point boundary when the layout crosses the sharing region -- at any boundary, the
    turn included: the executor's one p2p shape then carries the hand-off rows everywhere -- and
    never to the turn itself, which rank ``p-1`` hands on locally."""
    boundary_cost = handoff_cost if crosses_region(stage_sizes, modes) else 0.0
    return VStageLayout.from_sizes(stage_sizes, pipeline_parallel_size, costs, embedding_cost, output_cost, boundary_cost)


def balance_v_layout(
    costs: Sequence[float],
    pipeline_parallel_size: int,
    *,
    embedding_cost: float = 0.0,
    output_cost: float = 0.0,
    modes: Sequence[LayerMode] | None = None,
    handoff_cost: float = 0.0,
) -> VStageLayout:
    """The split of decoder layers over the ``2p`` V stages (V placement, Qi et al., NeurIPS
    2024: stage ``s`` on rank ``s`` and on rank ``2p-1-s``) with the cheapest slowest rank: a
    rank costs its two stages, rank 0 also the embedding (stage 0) and the output layer and loss
    (stage ``2p-1``); the hand-off as :func:`priced_v_layout` prices it. Arguments, the search
    and its ties as :func:`balance_layout` (``placement="v"`` of
    :func:`~epas_megatron.parallel.partition.best_split`; ties toward the even V split,
    :func:`~epas_megatron.model.v_placement.even_v_stage_sizes`). Every V stage holds at least
    one layer. No memory budget: the memory model does not price V placement's in-flight
    micro-batches per rank yet."""
    p = pipeline_parallel_size
    costs = [float(cost) for cost in costs]
    if not isinstance(p, int) or p < 2:
        raise ConfigError(f"V placement needs --pp >= 2, got {p!r}")
    if len(costs) < 2 * p:
        raise ConfigError(f"V placement over --pp {p} has 2 x {p} = {2 * p} stages of at least one decoder layer, but the "
                          f"model has {len(costs)}; lower --pp or raise --num-layers")

    def price(sizes):
        return priced_v_layout(sizes, p, costs, embedding_cost=embedding_cost, output_cost=output_cost, modes=modes,
                               handoff_cost=handoff_cost)

    return _balanced(costs, p, 2, "v", price, embedding_cost=embedding_cost, output_cost=output_cost, modes=modes,
                     handoff_cost=handoff_cost, fits=None, who="balance_v_layout")


def _balanced(costs, p, v, placement, price, *, embedding_cost, output_cost, modes, handoff_cost, fits, who):
    """The search behind :func:`balance_layout` and :func:`balance_v_layout`: both ways of the
    hand-off (a split keeping the region together, or one crossing it and paying at every
    point-to-point boundary), ``price(sizes)`` the layout of a split; the faster, on a tie the
    one without hand-off traffic."""
    n = len(costs)
    named = [*(f"layer {i}" for i in range(n)), "embedding", "output", "hand-off"]
    for what, cost in zip(named, [*costs, embedding_cost, output_cost, handoff_cost]):
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"{who}: cost of {what} must be finite and >= 0, got {cost!r}")
    if modes is not None and len(modes) != n:
        raise ValueError(f"{who}: {len(modes)} layer modes for {n} layer costs")

    prefix = [0.0, *itertools.accumulate(costs)]
    num_stages = p * v
    offsets = [0.0] * num_stages
    offsets[0] += embedding_cost
    offsets[-1] += output_cost
    crossing = [False] * (n + 1)
    if modes is not None and handoff_cost > 0:
        crossing = [0 < end < n and modes[end] == LayerMode.SHARE for end in range(n + 1)]
    searches = []  # (offsets, allowed stage ends): without hand-off traffic first
    if any(crossing):
        searches.append((offsets, [not cross for cross in crossing]))
        sends = [placement != "v" or VStageLayout.p2p_boundary(k, p) for k in range(num_stages + 1)]
        before = [0 < k and sends[k] for k in range(num_stages)]  # a p2p boundary before stage k
        after = [k < num_stages - 1 and sends[k + 1] for k in range(num_stages)]
        charged = [cost + handoff_cost * (before[k] + after[k]) for k, cost in enumerate(offsets)]
        searches.append((charged, [True] * (n + 1)))
    else:
        searches.append((offsets, [True] * (n + 1)))

    best, optimal = None, True
    tol = REL_TOL * (prefix[n] + embedding_cost + output_cost)
    for stage_offsets, allowed in searches:
        ends, proven = best_split(prefix, p, v, stage_offsets, allowed, fits=fits, placement=placement)
        optimal = optimal and proven
        if ends is None:
            continue
        layout = price([end - start for start, end in zip([0, *ends], ends)])
        if best is None or layout.bottleneck < best.bottleneck - tol:
            best = layout
    if best is None:
        raise ConfigError(getattr(fits, "failure", "no pipeline layout fits the memory budget"))
    return dataclasses.replace(best, optimal=optimal)


def balance_region(
    layer_costs: LayerCosts,
    shape: RegionShape | int,
    sharing_layers: Iterable[int],
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    *,
    memory=None,
) -> StageLayout:
    """The balanced layout while ``sharing_layers`` (a region of ``shape``, or of a model of
    that many layers: :func:`~epas_megatron.sharing.shape.as_shape`) share Q/K; ``memory``: a
    :class:`~epas_megatron.parallel.memory_budget.MemoryLimit` every rank must fit."""
    modes = as_shape(shape).modes(sharing_layers)
    return balance_layout(
        costs_for_modes(layer_costs, modes),
        pipeline_parallel_size,
        virtual_pipeline_parallel_size,
        embedding_cost=layer_costs.embedding,
        output_cost=layer_costs.output_layer,
        modes=modes,
        handoff_cost=layer_costs.handoff_p2p,
        fits=memory.for_modes(modes) if memory is not None else None,
    )


def balance_v_region(
    layer_costs: LayerCosts,
    shape: RegionShape | int,
    sharing_layers: Iterable[int],
    pipeline_parallel_size: int,
) -> VStageLayout:
    """The balanced V layout (:func:`balance_v_layout`) while ``sharing_layers`` (a region of
    ``shape``) share Q/K."""
    modes = as_shape(shape).modes(sharing_layers)
    return balance_v_layout(
        costs_for_modes(layer_costs, modes),
        pipeline_parallel_size,
        embedding_cost=layer_costs.embedding,
        output_cost=layer_costs.output_layer,
        modes=modes,
        handoff_cost=layer_costs.handoff_p2p,
    )


def _check_shape(num_layers: int, p: int, v: int):
    if not isinstance(p, int) or p < 1:
        raise ConfigError(f"--pp must be an integer >= 1, got {p!r}")
    if not isinstance(v, int) or v < 1:
        raise ConfigError(f"--vpp must be an integer >= 1, got {v!r}")
    if v > 1 and p == 1:
        raise ConfigError(
            f"--vpp {v} needs --pp > 1: the interleaved schedule splits model chunks over "
            "pipeline ranks (Megatron asks for --pp > 2 unless p2p overlap is on)"
        )
    if num_layers < 1:
        raise ConfigError(f"--num-layers must be >= 1, got {num_layers}")
    if p * v > num_layers:
        raise ConfigError(
            f"--pp {p} x --vpp {v} = {p * v} virtual pipeline stages need at least {p * v} "
            f"decoder layers (one per stage), but the model has {num_layers}; lower --pp or "
            "--vpp, or allow empty stages in --pipeline-layout"
        )
