"""Memory-aware rebalancing: with a per-rank budget the balancer picks the fastest layout whose
every rank fits (checked against brute force over all splits), reports when the FLOP-optimal
layout would not have fitted, and says clearly when nothing fits."""

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.metrics.rank_memory import RankMemorySettings
from epas_megatron.model.architecture import LlamaArchitecture, ModelShape
from epas_megatron.parallel.balancer import balance_region, priced_layout
from epas_megatron.parallel.memory_budget import GIB, MemoryLimit, layout_within_budget
from epas_megatron.parallel.stage_layouts import flops_layer_costs
from epas_megatron.sharing.shape import layer_modes

# The rebalancing tests' shape (attention-heavy, ffn 64): at region 0 the FLOP-optimal PP=2
# layout puts 5 layers on rank 0 (the LM head sits on rank 1), and rank 0 also keeps the most
# micro-batches in flight (2 of 8 under 1F1B, against rank 1's one).
ARCH = LlamaArchitecture(8, 128, 4, 4, 64, 1024, 64)
SHAPE = ModelShape(ARCH, seq_length=64, micro_batch_size=4)
SETTINGS = RankMemorySettings(num_microbatches=8)
COSTS = flops_layer_costs(ARCH, 64)


def limit(budget_bytes):
    return MemoryLimit(SHAPE, SETTINGS, pp=2, vpp=1, budget_bytes=budget_bytes)


def brute_force(region, budget_bytes):
    """The fastest 2-stage split whose ranks fit, trying every split."""
    modes = layer_modes(8, tuple(range(8 - region, 8)))
    best = None
    for first in range(1, 8):
        layout = priced_layout([first, 8 - first], 2, 1, [COSTS.for_mode(m) for m in modes], embedding_cost=COSTS.embedding,
                               output_cost=COSTS.output_layer, modes=modes, handoff_cost=COSTS.handoff_p2p)
        if max(r["total"] for r in limit(budget_bytes).layout_bytes(layout, modes)) <= budget_bytes:
            if best is None or layout.bottleneck < best.bottleneck:
                best = layout
    return best


def test_a_budget_moves_layers_off_the_first_stage():
    modes = layer_modes(8, ())
    unconstrained = balance_region(COSTS, 8, (), 2)
    assert unconstrained.to_layout_string() == "Ettttt|tttL"
    need = limit(1e18).layout_bytes(unconstrained, modes)
    assert need[0]["in_flight"] == 2 and need[1]["in_flight"] == 1
    budget = need[0]["total"] - 1  # the FLOP-optimal first stage is one byte over
    chosen, notice = layout_within_budget(lambda: balance_region(COSTS, 8, (), 2),
                                      lambda: balance_region(COSTS, 8, (), 2, memory=limit(budget)), limit(budget), modes)
    assert chosen.to_layout_string() == brute_force(0, budget).to_layout_string() != unconstrained.to_layout_string()
    assert max(r["total"] for r in limit(budget).layout_bytes(chosen, modes)) <= budget
    assert "FLOP-optimal layout Ettttt|tttL would need" in notice and "pipeline rank 0" in notice


@pytest.mark.parametrize("region", [0, 3, 6])
def test_budgeted_layout_equals_brute_force(region):
    sharing = tuple(range(8 - region, 8))
    modes = layer_modes(8, sharing)
    loose = limit(1e18).layout_bytes(balance_region(COSTS, 8, sharing, 2), modes)
    for budget in (loose[0]["total"] * 0.9, loose[1]["total"] * 0.97, max(r["total"] for r in loose)):
        expected = brute_force(region, budget)
        if expected is None:
            with pytest.raises(ConfigError, match="--epas-memory-budget-gb"):
                balance_region(COSTS, 8, sharing, 2, memory=limit(budget))
            continue
        got = balance_region(COSTS, 8, sharing, 2, memory=limit(budget))
        assert got.bottleneck == pytest.approx(expected.bottleneck)


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"no pipeline layout keeps every rank within --epas-memory-budget-gb 1e-06"):
        balance_region(COSTS, 8, (), 2, memory=limit(1e-6 * GIB))


def test_no_budget_changes_nothing():
    modes = layer_modes(8, (6, 7))
    chosen, notice = layout_within_budget(lambda: balance_region(COSTS, 8, (6, 7), 2), None, None, modes)
    assert notice is None and chosen == balance_region(COSTS, 8, (6, 7), 2)
