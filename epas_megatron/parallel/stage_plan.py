"""Pipeline layouts for a run: FLOP-based layer costs -> planner -> Megatron layout string.

With PP > 1 the EPAS region grows from the deep end, so without rebalancing the last stages get
cheaper while the first keep computing everything, and the pipeline runs at the pace of its
slowest stage. At every switch the trainer asks :func:`plan_stage_layout` for the layout that
minimises the slowest stage under the new per-layer costs (ties toward moving fewer layers), and
moves layers by reloading its staging checkpoint into the new layout.

Costs are forward matmul FLOPs per sequence (a computing layer, a sharing layer, the LM head and
loss on the last stage; the embedding gather is free). Backward is ~2x forward for every part,
so the ratios -- all the planner needs -- hold for training.
"""

from __future__ import annotations

from typing import Optional, Sequence

from epas_megatron.parallel.cost_model import LayerCosts, costs_for_modes
from epas_megatron.parallel.planner import StageLayout, format_plan, plan_layout
from epas_megatron.sharing.schedule import layer_modes


def flops_layer_costs(arch, seq_length: int, share: str = "qk") -> LayerCosts:
    """Relative costs from the sharing-aware FLOPs model (see module doc)."""
    from epas_megatron.metrics.flops import Convention, layer_forward_flops, lm_head_forward_flops

    shape = arch.flops_shape(seq_length)
    return LayerCosts(
        compute_layer=float(layer_forward_flops(shape, "compute", Convention.MEGATRON)),
        share_layer=float(layer_forward_flops(shape, f"share_{share}", Convention.MEGATRON)),
        embedding=0.0,
        output_layer=float(lm_head_forward_flops(shape)),
    )


def plan_for_region(
    layer_costs: LayerCosts,
    num_layers: int,
    pp: int,
    vpp: Optional[int],
    sharing_layers: Sequence[int],
    previous: Optional[str] = None,
) -> StageLayout:
    """The planned layout for one sharing region (ties toward the ``previous`` layout string)."""
    modes = [str(m) for m in layer_modes(num_layers, sharing_layers)]
    current = StageLayout.from_layout_string(previous, pp) if previous else None
    return plan_layout(
        costs_for_modes(layer_costs, modes),
        pp,
        vpp or 1,
        embedding_cost=layer_costs.embedding,
        output_cost=layer_costs.output_layer,
        current=current,
    )


def plan_stage_layout(plan, sharing_layers: Sequence[int], timer=None) -> StageLayout:
    """The layout for ``sharing_layers`` given a :class:`~epas_megatron.model.build_plan.BuildPlan`
    (its architecture, sequence length, share mode, PP/VPP and current layout).

    With a :class:`~epas_megatron.parallel.layer_timing.LayerTimer` (``--epas-cost-model
    measured``) the FLOPs costs are calibrated by its measurements (a collective call)."""
    from epas_megatron.parallel.layer_timing import calibrated_costs

    costs = calibrated_costs(flops_layer_costs(plan.arch, plan.seq_length, plan.share), timer)
    previous = plan.layout_string
    return plan_for_region(costs, plan.arch.num_layers, plan.pp, plan.vpp, sharing_layers, previous)


def describe_schedule_layouts(plan, schedule) -> str:
    """The layouts planned for every region of the schedule (printed at start)."""
    costs = flops_layer_costs(plan.arch, plan.seq_length, plan.share)
    regions = [(0, ())] + [(it, schedule.sharing_layers(it)) for it, _ in schedule.switch_iterations()]
    return format_plan(costs, plan.arch.num_layers, plan.pp, plan.vpp or 1, regions)
