"""Per-layer cost model: modes to costs, the hand-off's p2p cost, calibration to measured
times."""

import math

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.parallel.cost_model import LayerCosts, calibrate, costs_for_modes
from epas_megatron.parallel.stage_layouts import flops_layer_costs
from epas_megatron.sharing.shape import LayerMode, layer_modes


def test_costs_for_modes_source_costs_like_compute():
    costs = LayerCosts(compute_layer=10.0, share_layer=8.0, embedding=1.0, output_layer=3.0)
    assert costs_for_modes(costs, layer_modes(6, [3, 4, 5])) == [10.0, 10.0, 10.0, 8.0, 8.0, 8.0]
    modes = ["compute", "compute", "source", "share", "share", "compute"]  # plain strings work too
    assert costs_for_modes(costs, modes) == [10.0, 10.0, 10.0, 8.0, 8.0, 10.0]
    assert costs_for_modes(costs, []) == []
    assert costs.for_mode(LayerMode.SOURCE) == 10.0
    assert costs.handoff_p2p == 0.0


def test_costs_for_modes_rejects_unknown_mode():
    costs = LayerCosts(10.0, 8.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="'shared'"):
        costs_for_modes(costs, ["compute", "shared"])


@pytest.mark.parametrize(
    "field", ["compute_layer", "share_layer", "embedding", "output_layer", "handoff_p2p"]
)
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_layer_costs_rejects_bad_values(field, bad):
    values = dict(compute_layer=1.0, share_layer=1.0, embedding=0.0, output_layer=0.0)
    values[field] = bad
    with pytest.raises(ConfigError, match=field):
        LayerCosts(**values)


def test_flops_costs_price_the_hand_off_rows():
    """8 layers, h = 128, 4 heads and 4 KV groups of 32, s = 64: the Q/K hand-off is
    (4 + 4) * 32 = 256 elements per token, 256 * 64 / 128 = 128 extra rows of 128 bf16 elements,
    sent forward and back: 65536 bytes, at 4000 FLOPs a byte, over 3 (forward stands for
    forward + backward)."""
    arch = LlamaArchitecture(8, 128, 4, 4, 64, 1024, 64)
    assert flops_layer_costs(arch, 64).handoff_p2p == pytest.approx(65536 * 4000 / 3)
    # KV sharing hands on K and V: 2 * 4 groups, the same here; with 2 groups (GQA) 4 * 32 per
    # token for K/V but 6 * 32 for Q/K.
    gqa = LlamaArchitecture(8, 128, 4, 2, 64, 1024, 64)
    assert flops_layer_costs(gqa, 64, "kv").handoff_p2p == pytest.approx(2 * 64 * 128 * 2 * 4000 / 3)
    assert flops_layer_costs(gqa, 64, "qk").handoff_p2p == pytest.approx(2 * 96 * 128 * 2 * 4000 / 3)
    # In fp32 over a link twice as fast per FLOP: the same number.
    same = flops_layer_costs(arch, 64, p2p_flops_per_byte=2000.0, bytes_per_element=4)
    assert same.handoff_p2p == pytest.approx(65536 * 4000 / 3)


def test_calibrate_docstring_example():
    flops = LayerCosts(compute_layer=10.0, share_layer=8.0, embedding=1.0, output_layer=3.0)
    timed = calibrate(flops, {"compute_layer": 0.020, "share_layer": 0.017})
    scale = 0.037 / 18.0
    assert timed.compute_layer == 0.020
    assert timed.share_layer == 0.017
    assert timed.embedding == pytest.approx(1.0 * scale)
    assert timed.output_layer == pytest.approx(3.0 * scale)


def test_calibrate_one_kind_scales_everything_else_by_its_ratio():
    flops = LayerCosts(compute_layer=10.0, share_layer=8.0, embedding=1.0, output_layer=3.0)
    timed = calibrate(flops, {"compute": 0.5})  # mode-name alias
    assert timed.compute_layer == 0.5
    assert (timed.share_layer, timed.embedding, timed.output_layer) == pytest.approx((0.4, 0.05, 0.15))


def test_calibrate_all_kinds_replaces_all():
    flops = LayerCosts(10.0, 8.0, 1.0, 3.0)
    measured = {"compute_layer": 4.0, "share_layer": 3.0, "embedding": 0.2, "output_layer": 1.0}
    assert calibrate(flops, measured) == LayerCosts(4.0, 3.0, 0.2, 1.0)


def test_calibrate_scales_an_unmeasured_hand_off_with_the_rest():
    flops = LayerCosts(10.0, 8.0, 1.0, 3.0, handoff_p2p=2.0)
    timed = calibrate(flops, {"compute_layer": 5.0})
    assert timed.handoff_p2p == pytest.approx(1.0)
    assert calibrate(flops, {"compute": 5.0, "handoff_p2p": 0.25}).handoff_p2p == 0.25


def test_calibrate_keeps_relative_costs_for_the_planner():
    """Scaling every kind by the same factor changes no ratio, so no plan."""
    flops = LayerCosts(12.0, 9.0, 2.0, 5.0)
    timed = calibrate(flops, {"compute_layer": 6.0})
    assert timed.share_layer / timed.compute_layer == pytest.approx(0.75)
    assert timed.output_layer / timed.embedding == pytest.approx(2.5)


@pytest.mark.parametrize(
    "measured, match",
    [
        ({}, "nothing measured"),
        ({"attention": 1.0}, "unknown cost kind 'attention'"),
        ({"compute_layer": 0.0}, "> 0"),
        ({"compute_layer": -1.0}, "> 0"),
        ({"share_layer": math.nan}, "> 0"),
        ({"compute": 1.0, "compute_layer": 1.0}, "measured twice"),
    ],
)
def test_calibrate_rejects(measured, match):
    with pytest.raises(ValueError, match=match):
        calibrate(LayerCosts(10.0, 8.0, 1.0, 3.0), measured)


def test_calibrate_needs_a_nonzero_model_cost_to_scale_from():
    with pytest.raises(ValueError, match="all 0"):
        calibrate(LayerCosts(10.0, 8.0, 0.0, 3.0), {"embedding": 0.1})
