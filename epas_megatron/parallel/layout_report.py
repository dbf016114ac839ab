"""Reports on balanced pipeline layouts: the layout table printed at start, and the predicted
throughput gain of EPAS under pipeline parallelism (used by ``epas-bench pipeline``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epas_megatron.model.stage_layout import StageLayout, VStageLayout
from epas_megatron.model.v_placement import even_v_stage_sizes
from epas_megatron.parallel.balancer import balance_region, balance_v_region, crosses_region, priced_layout, priced_v_layout
from epas_megatron.parallel.cost_model import LayerCosts, costs_for_modes
from epas_megatron.sharing.shape import RegionShape, as_shape


def even_layout(
    layer_costs: LayerCosts,
    shape: RegionShape | int,
    sharing_layers: Iterable[int],
    p: int,
    v: int = 1,
    *,
    placement: str = "interleaved",
) -> StageLayout | VStageLayout:
    """Megatron's even split (``placement="v"``: the even V split over ``2p`` stages), priced
    while ``sharing_layers`` (a region of ``shape``) share (the hand-off charged when the split
    crosses the region)."""
    shape = as_shape(shape)
    modes = shape.modes(sharing_layers)
    if placement == "v":
        return priced_v_layout(even_v_stage_sizes(shape.num_layers, p), p, costs_for_modes(layer_costs, modes),
                               embedding_cost=layer_costs.embedding, output_cost=layer_costs.output_layer, modes=modes,
                               handoff_cost=layer_costs.handoff_p2p)
    return priced_layout(
        StageLayout.even(shape.num_layers, p, v).stage_sizes,
        p,
        v,
        costs_for_modes(layer_costs, modes),
        embedding_cost=layer_costs.embedding,
        output_cost=layer_costs.output_layer,
        modes=modes,
        handoff_cost=layer_costs.handoff_p2p,
    )


def format_layouts(
    layer_costs: LayerCosts,
    shape: RegionShape | int,
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    sharing_sets: Sequence[tuple[int, Iterable[int]]] = (),
    layouts: Sequence[tuple[int, StageLayout | VStageLayout]] | None = None,
    *,
    placement: str = "interleaved",
) -> str:
    """A readable table of a schedule's layouts.

    ``sharing_sets`` lists ``(iteration, sharing layers)``, each the complete region (of
    ``shape``) from that iteration on; ``layouts`` the
    ``(iteration, layout)`` for each (default: :func:`balance_region`).
    Per switch: the layers each rank holds (``a-b`` per chunk, chunks separated by commas), its
    predicted cost under the balanced layout and under the fixed even split, the bottlenecks, and
    the speedups over the baseline (no sharing, even split): ``fixed`` keeps the even split,
    ``rebal`` switches to the balanced layout. Speedup = baseline bottleneck / bottleneck (see
    :func:`predict_pipeline_speedup`).

    ``placement="v"``: V placement (``v`` is 2; :func:`~epas_megatron.parallel.balancer.balance_v_region`
    and the even V split), each rank's two chunks its stages ``r`` and ``2p-1-r``, the layout as
    ``--pipeline-layout`` takes it under a V schedule.
    """
    p, v = pipeline_parallel_size, (2 if placement == "v" else virtual_pipeline_parallel_size)
    shape = as_shape(shape)
    sharing_sets = [(iteration, sorted(set(sharing))) for iteration, sharing in sharing_sets]
    if layouts is None:
        balance = ((lambda sharing: balance_v_region(layer_costs, shape, sharing, p)) if placement == "v"
                   else (lambda sharing: balance_region(layer_costs, shape, sharing, p, v)))
        layouts = [(iteration, balance(sharing)) for iteration, sharing in sharing_sets]
    if len(layouts) != len(sharing_sets):
        raise ValueError("format_layouts: layouts and sharing_sets differ in length")
    baseline = even_layout(layer_costs, shape, (), p, v, placement=placement).bottleneck
    parallel = f"--pp {p}, V placement ({2 * p} stages)" if placement == "v" else f"--pp {p} --vpp {v}"
    flag = "--pipeline-layout" if placement == "v" else "--pipeline-model-parallel-layout"
    lines = [
        f"pipeline plan: {shape.num_layers} layers, {parallel}; baseline (no sharing, even "
        f"split) bottleneck {baseline:.4g}"
    ]
    for (iteration, sharing), (layout_iteration, layout) in zip(sharing_sets, layouts):
        if iteration != layout_iteration:
            raise ValueError("format_layouts: layouts and sharing_sets differ in iterations")
        fixed = even_layout(layer_costs, shape, sharing, p, v, placement=placement)
        crossing = crosses_region(layout.stage_sizes, shape.modes(sharing))
        notes = "; Q/K cross a stage boundary" if crossing else ""
        if not layout.optimal:
            notes += " (search budget hit: best found, not proven optimal)"
        lines.append("")
        lines.append(
            f"iteration {iteration}: {len(sharing)} sharing layers "
            f"({_compress(sharing) if sharing else 'none'}){notes}"
        )
        lines.append(f"  {flag} {layout.to_layout_string(compact=True)}")
        width = max(len("layers"), *(len(_ranges_text(layout, r)) for r in range(p)))
        lines.append(f"  {'rank':>4}  {'layers':<{width}}  {'cost':>9}  {'even-split':>10}")
        for r in range(p):
            lines.append(
                f"  {r:>4}  {_ranges_text(layout, r):<{width}}  {layout.rank_costs[r]:>9.4g}  "
                f"{fixed.rank_costs[r]:>10.4g}"
            )
        lines.append(
            f"  bottleneck {layout.bottleneck:.4g} (even split {fixed.bottleneck:.4g}); "
            f"speedup vs baseline: rebal {baseline / layout.bottleneck:.3f}x, "
            f"fixed {baseline / fixed.bottleneck:.3f}x"
        )
    return "\n".join(lines)


def _ranges_text(layout: StageLayout | VStageLayout, pp_rank: int) -> str:
    parts = []
    for vp in range(layout.virtual_pipeline_parallel_size):
        ids = layout.layer_range(pp_rank, vp)
        if len(ids) == 0:
            parts.append("-")
        elif len(ids) == 1:
            parts.append(f"{ids.start}")
        else:
            parts.append(f"{ids.start}-{ids.stop - 1}")
    return ",".join(parts)


def _compress(layers: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class PipelineSpeedup:
    """Predicted effect of an EPAS sharing region on pipeline throughput.

    Model: every microbatch passes every rank and the pipeline advances at its slowest rank, so
    iteration time is proportional to the bottleneck rank's cost times ``(microbatches + p - 1)``
    (1F1B; the interleaved schedule changes the factor, not the ratio). With ``p`` and the
    microbatch count unchanged the factor cancels: a speedup is a ratio of bottlenecks. The
    bottlenecks include the hand-off's p2p cost when a layout crosses the sharing region
    (``LayerCosts.handoff_p2p``); the hidden states' own p2p and the bubble are left out.
    """

    baseline_bottleneck: float
    """No sharing, Megatron's even split (what runs without EPAS)."""

    baseline_rebalanced_bottleneck: float
    """No sharing, balanced split (rebalancing alone, e.g. for embedding/output costs)."""

    fixed_bottleneck: float
    """Sharing region on, even split kept."""

    rebalanced_bottleneck: float
    """Sharing region on, balanced split."""

    ideal_speedup: float
    """Total-cost ratio (no sharing / sharing), without p2p: the speedup if both pipelines
    were perfectly balanced, as on a single device."""

    @property
    def speedup_without_rebalancing(self) -> float:
        return self.baseline_bottleneck / self.fixed_bottleneck

    @property
    def speedup_with_rebalancing(self) -> float:
        return self.baseline_bottleneck / self.rebalanced_bottleneck

    @property
    def speedup_over_rebalanced_baseline(self) -> float:
        """EPAS's own share of the gain: both sides rebalanced."""
        return self.baseline_rebalanced_bottleneck / self.rebalanced_bottleneck


def predict_pipeline_speedup(
    layer_costs: LayerCosts,
    shape: RegionShape | int,
    pipeline_parallel_size: int,
    virtual_pipeline_parallel_size: int = 1,
    region_size: int = 0,
) -> PipelineSpeedup:
    """Predicted pipeline throughput gain of EPAS with ``region_size`` layers in sharing mode
    (the region of that size of ``shape``: its blocks, each with its source just before it),
    with and without rebalancing the stages; see :class:`PipelineSpeedup` for the model."""
    p, v = pipeline_parallel_size, virtual_pipeline_parallel_size
    shape = as_shape(shape)
    sharing = shape.layers(region_size, flag="sharing region size")
    fixed_costs = layer_costs.embedding + layer_costs.output_layer

    def total(region) -> float:
        return math.fsum(costs_for_modes(layer_costs, shape.modes(region))) + fixed_costs

    return PipelineSpeedup(
        baseline_bottleneck=even_layout(layer_costs, shape, (), p, v).bottleneck,
        baseline_rebalanced_bottleneck=balance_region(layer_costs, shape, (), p, v).bottleneck,
        fixed_bottleneck=even_layout(layer_costs, shape, sharing, p, v).bottleneck,
        rebalanced_bottleneck=balance_region(layer_costs, shape, sharing, p, v).bottleneck,
        ideal_speedup=total(()) / total(sharing),
    )
