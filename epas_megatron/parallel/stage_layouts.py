"""Pipeline layouts for a run: FLOP-based layer costs -> balancer -> Megatron layout string.

With PP > 1 the EPAS region grows from the deep end, so without rebalancing the last stages get
cheaper while the first keep computing everything, and the pipeline runs at the pace of its
slowest stage. At every switch the trainer asks :func:`balanced_layout` for the layout that
minimises the slowest stage under the new per-layer costs (including the extra p2p rows a stage
boundary inside the region sends), rebuilds its model chunks in that layout and moves the
training state into them: in memory by default (``--epas-switch-mode memory``; a layer that
changes stage is sent point to point, see :mod:`epas_megatron.checkpointing.in_memory`), or
through a staging checkpoint (``--epas-switch-mode checkpoint``). Either way the state is
matched by checkpoint shard id, so the layout chosen does not depend on where the layers were
before. Under a V pipeline schedule (V placement: ``2p`` stages, two per rank) the same happens
with V stage sizes (:func:`balanced_v_layout`, a
:class:`~epas_megatron.model.stage_layout.VStageLayout`).

Costs are forward matmul FLOPs per sequence (a computing layer, a sharing layer, the LM head and
loss on the last stage; the embedding gather is free). Backward is ~2x forward for every part,
so the ratios -- all the balancer needs -- hold for training.
"""

from __future__ import annotations

from typing import Optional, Sequence

from epas_megatron.model.stage_layout import StageLayout, VStageLayout
from epas_megatron.parallel.balancer import balance_region, balance_v_region
from epas_megatron.parallel.cost_model import P2P_FLOPS_PER_BYTE, LayerCosts
from epas_megatron.parallel.layout_report import format_layouts
from epas_megatron.sharing.shape import RegionShape


def flops_layer_costs(
    arch,
    seq_length: int,
    share: str = "qk",
    p2p_flops_per_byte: float = P2P_FLOPS_PER_BYTE,
    bytes_per_element: int = 2,
) -> LayerCosts:
    """Relative costs from the sharing-aware FLOPs model (see module doc), plus the hand-off's
    extra p2p rows (``LayerCosts.handoff_p2p``) in FLOP units at ``p2p_flops_per_byte``, with
    ``bytes_per_element`` bytes per element in the p2p tensor (bf16 by default)."""
    from epas_megatron.metrics.flops import Convention, layer_forward_flops, lm_head_forward_flops
    from epas_megatron.model.architecture import ModelShape
    from epas_megatron.sharing.handoff import extra_p2p_rows

    shape = ModelShape(arch, seq_length)
    # Hand-off elements per token: Q and K heads, or K and V (at TP=1; under TP both the rows
    # and a rank's FLOPs shrink by TP, so the ratio holds).
    first = shape.num_attention_heads if share == "qk" else shape.num_query_groups
    heads = first + shape.num_query_groups
    rows = extra_p2p_rows(heads * shape.head_dim, seq_length, shape.hidden_size)
    # Sent forward (activations) and back (gradients); / 3 because the costs here are forward
    # FLOPs standing for forward + backward (3x).
    handoff_bytes = 2 * rows * shape.hidden_size * bytes_per_element
    return LayerCosts(
        compute_layer=float(layer_forward_flops(shape, "compute", Convention.MEGATRON)),
        share_layer=float(layer_forward_flops(shape, f"share_{share}", Convention.MEGATRON)),
        embedding=0.0,
        output_layer=float(lm_head_forward_flops(shape)),
        handoff_p2p=handoff_bytes * p2p_flops_per_byte / 3,
    )


def region_layout(
    layer_costs: LayerCosts,
    shape: RegionShape | int,
    pp: int,
    vpp: Optional[int],
    sharing_layers: Sequence[int],
) -> StageLayout:
    """The balanced layout for one sharing region (of ``shape``)."""
    return balance_region(layer_costs, shape, sharing_layers, pp, vpp or 1)


def balanced_layout(plan, sharing_layers: Sequence[int], timer=None, memory=None) -> StageLayout:
    """The layout for ``sharing_layers`` given a :class:`~epas_megatron.model.build_plan.BuildPlan`
    (its architecture, sequence length, share mode, PP/VPP and region shape).

    With a :class:`~epas_megatron.parallel.layer_timing.LayerTimer` (``--epas-cost-model
    measured``) the FLOPs costs are calibrated by its measurements (a collective call). With a
    :class:`~epas_megatron.parallel.memory_budget.MemoryLimit`, only layouts whose every rank
    fits it (:func:`balanced_layout_noted` also says when that changed the layout)."""
    return balanced_layout_noted(plan, sharing_layers, timer, memory)[0]


def balanced_layout_noted(plan, sharing_layers: Sequence[int], timer=None, memory=None) -> tuple[StageLayout, Optional[str]]:
    """:func:`balanced_layout` and the memory budget's notice (None if it changed nothing)."""
    from epas_megatron.parallel.layer_timing import calibrated_costs
    from epas_megatron.parallel.memory_budget import layout_within_budget

    costs = calibrated_costs(flops_layer_costs(plan.arch, plan.seq_length, plan.share), timer)
    return layout_within_budget(
        lambda: balance_region(costs, plan.shape, sharing_layers, plan.pp, plan.vpp or 1),
        lambda: balance_region(costs, plan.shape, sharing_layers, plan.pp, plan.vpp or 1, memory=memory),
        memory, plan.shape.modes(sharing_layers))


def balanced_v_layout(plan, sharing_layers: Sequence[int], timer=None) -> VStageLayout:
    """The V layout (:func:`~epas_megatron.parallel.balancer.balance_v_region`) for
    ``sharing_layers`` given a V placement's :class:`~epas_megatron.model.build_plan.BuildPlan`
    (one with ``v_stage_sizes``), from the FLOPs costs calibrated by a ``timer`` as
    :func:`balanced_layout`'s. No memory budget (see there)."""
    from epas_megatron.parallel.layer_timing import calibrated_costs

    costs = calibrated_costs(flops_layer_costs(plan.arch, plan.seq_length, plan.share), timer)
    return balance_v_region(costs, plan.shape, sharing_layers, plan.pp)


def describe_schedule_layouts(plan, schedule, memory=None) -> str:
    """The balanced layouts of every region of the schedule (printed at start), within the
    memory budget if there is one (with a line per region where the budget changed the layout).
    Under V placement (``plan.v_stage_sizes`` set) the V layouts, without a budget."""
    costs = flops_layer_costs(plan.arch, plan.seq_length, plan.share)
    regions = [(0, ())] + [(it, schedule.sharing_layers(it)) for it, _ in schedule.switch_iterations()]
    if plan.v_stage_sizes is not None:
        layouts = [(iteration, balanced_v_layout(plan, sharing)) for iteration, sharing in regions]
        return format_layouts(costs, RegionShape.of(schedule), plan.pp, 2, regions, layouts=layouts, placement="v")
    layouts, notices = [], []
    for iteration, sharing in regions:
        layout, notice = balanced_layout_noted(plan, sharing, None, memory)
        layouts.append((iteration, layout))
        if notice:
            notices.append(f"  memory budget at iteration {iteration}: {notice}")
    table = format_layouts(costs, RegionShape.of(schedule), plan.pp, plan.vpp or 1, regions, layouts=layouts)
    return "\n".join([table, *notices])
