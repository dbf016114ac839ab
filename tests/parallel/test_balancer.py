"""Pipeline-stage balancer: optimality and tie-breaks against brute force, hand-computed layouts
(hand-off cost, interleaving), Megatron layout strings, reports and predictions."""

import itertools
import math
import random

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.model.stage_layout import StageLayout
from epas_megatron.parallel.balancer import balance_layout, balance_region
from epas_megatron.parallel.cost_model import LayerCosts
from epas_megatron.parallel.layout_report import PipelineSpeedup, format_layouts, predict_pipeline_speedup
from epas_megatron.parallel.partition import best_split
from epas_megatron.sharing.shape import LayerMode, RegionShape, layer_modes

# --------------------------------------------------------------------------------------------
# Brute force: every contiguous split, priced and ranked by the documented rules


def _splits(n, num_stages):
    """All stage-size tuples (each >= 1, summing to n)."""
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))


def _rank_costs(sizes, costs, p, emb, out, modes=None, handoff=0.0):
    """Each rank's cost, spelled out: its layers, the embedding on stage 0, the output on the last
    stage and, when some stage starts with a sharing layer, `handoff` per boundary side."""
    ends = list(itertools.accumulate(sizes))
    crosses = modes is not None and any(e < len(costs) and modes[e] == LayerMode.SHARE for e in ends)
    ranks, start, last = [0.0] * p, 0, len(sizes) - 1
    for k, end in enumerate(ends):
        ranks[k % p] += sum(costs[start:end])
        if crosses:
            ranks[k % p] += handoff * ((k > 0) + (k < last))
        start = end
    ranks[0] += emb
    ranks[(len(sizes) - 1) % p] += out
    return ranks, crosses


def _brute_force(costs, p, v=1, emb=0.0, out=0.0, modes=None, handoff=0.0):
    """(bottleneck, sizes): the smallest bottleneck; among splits within 1e-9 of the total cost
    of it, no hand-off traffic first (when it costs anything), then the smallest sum of
    |stage end - even split's stage end|, then the smallest stage ends listed rank by rank."""
    n, num_stages = len(costs), p * v
    even_ends = list(itertools.accumulate(StageLayout.even(n, p, v).stage_sizes))
    scored = []
    for sizes in _splits(n, num_stages):
        ranks, crosses = _rank_costs(sizes, costs, p, emb, out, modes, handoff)
        scored.append((max(ranks), crosses, sizes))
    best = min(value for value, _, _ in scored)
    tol = 1e-9 * (sum(costs) + emb + out)

    def key(entry):
        _, crosses, sizes = entry
        ends = list(itertools.accumulate(sizes))
        rank_major = [ends[k] for k in sorted(range(num_stages), key=lambda k: (k % p, k // p))]
        distance = sum(abs(a - b) for a, b in zip(ends, even_ends))
        return crosses and handoff > 0, distance, rank_major

    return best, min((entry for entry in scored if entry[0] <= best + tol), key=key)[2]


def _check(costs, p, v=1, emb=0.0, out=0.0, modes=None, handoff=0.0):
    expected_bottleneck, expected_sizes = _brute_force(costs, p, v, emb, out, modes, handoff)
    layout = balance_layout(
        costs, p, v, embedding_cost=emb, output_cost=out, modes=modes, handoff_cost=handoff
    )
    context = (costs, p, v, emb, out, modes, handoff)
    assert layout.optimal
    assert layout.bottleneck == pytest.approx(expected_bottleneck, rel=1e-12, abs=1e-12), context
    assert layout.stage_sizes == expected_sizes, context
    ranks, _ = _rank_costs(layout.stage_sizes, costs, p, emb, out, modes, handoff)
    assert layout.rank_costs == pytest.approx(ranks, rel=1e-12, abs=1e-12)
    return layout


def _cost_vectors(n, rng):
    """Integer costs (many exact ties), uniform costs, random floats, an EPAS-like profile."""
    yield [float(rng.randint(0, 4)) for _ in range(n)]
    yield [1.0] * n
    yield [rng.uniform(0.1, 2.0) for _ in range(n)]
    region = rng.randint(0, n - 1)
    yield [1.0] * (n - region) + [0.8] * region


# --------------------------------------------------------------------------------------------
# Optimality and tie-breaks


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_single_chunk_matches_brute_force(p):
    rng = random.Random(p)
    for n in range(p, 11):
        for costs in _cost_vectors(n, rng):
            for emb, out in [(0.0, 0.0), (1.0, 2.0), (rng.uniform(0, 3), rng.uniform(0, 3))]:
                _check(costs, p, 1, emb, out)


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (2, 3), (4, 2)])
def test_interleaved_matches_brute_force(p, v):
    rng = random.Random(10 * p + v)
    for n in range(p * v, 11):
        for costs in _cost_vectors(n, rng):
            for emb, out in [(0.0, 0.0), (1.0, 2.0), (rng.uniform(0, 3), rng.uniform(0, 3))]:
                _check(costs, p, v, emb, out)


@pytest.mark.parametrize("p, v", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)])
def test_handoff_cost_matches_brute_force(p, v):
    """EPAS regions with a hand-off cost from negligible to dominant."""
    rng = random.Random(100 + 10 * p + v)
    for _ in range(60):
        n = rng.randint(p * v, 10)
        region = rng.randint(1, n - 1)
        modes = layer_modes(n, range(n - region, n))
        costs = [rng.choice([0.5, 0.84]) if mode == LayerMode.SHARE else 1.0 for mode in modes]
        handoff = rng.choice([0.0, 0.05, 0.3, 1.0, 5.0])
        _check(costs, p, v, rng.choice([0.0, 0.3]), rng.choice([0.0, 0.65, 2.0]), modes, handoff)


def test_a_single_stage_is_the_whole_model():
    layout = balance_layout([1.0, 2.0, 3.0], 1, embedding_cost=0.5, output_cost=0.25)
    assert layout.stage_sizes == (3,)
    assert layout.bottleneck == pytest.approx(6.75)
    assert layout.to_layout_string() == "EtttL"


def test_embedding_and_output_costs_shift_layers_off_the_end_ranks():
    # Bottleneck 3 needs rank 0 <= 2 layers and rank 3 <= 1; of (2,2,3,1), (2,3,2,1) and
    # (1,3,3,1), (2,2,3,1) has the stage ends (2,4,7,8) nearest the even (2,4,6,8).
    layout = balance_layout([1.0] * 8, 4, embedding_cost=1.0, output_cost=2.0)
    assert layout.stage_sizes == (2, 2, 3, 1)
    assert layout.rank_costs == (3.0, 2.0, 3.0, 3.0)


def test_equally_fast_splits_go_to_the_even_split():
    assert balance_layout([1.0] * 5, 2).stage_sizes == (3, 2)  # (2, 3) is as fast
    assert balance_layout([1.0] * 8, 2, 2).stage_sizes == (2, 2, 2, 2)  # so is (1, 3, 3, 1)


def test_cheaper_deep_layers_move_the_boundaries_deeper():
    """16 layers on 4 ranks, the deep half at half cost: 12 in all, so every rank must cost
    exactly 3: three full layers on ranks 0 and 1, two full and two halves, six halves."""
    layout = balance_layout([1.0] * 8 + [0.5] * 8, 4)
    assert layout.stage_sizes == (3, 3, 4, 6)
    assert layout.rank_costs == (3.0, 3.0, 3.0, 3.0)


def test_interleaving_trades_layers_between_a_ranks_chunks():
    """Six full layers and two halves on 2 ranks x 2 chunks: 7 in all, 3.5 per rank needs the
    layer 6 half on rank 0 (chunk 1 ends at 7) and layer 7 alone on rank 1's last chunk. Of the
    two such splits, (1,3,3,1) and (2,3,2,1), both 2 away from the even ends, the first has the
    smaller ends on rank 0. Balancing each virtual stage instead (even split: no stage above 2)
    leaves a rank at 4.0, 14% slower."""
    costs = [1.0] * 6 + [0.5] * 2
    layout = balance_layout(costs, 2, 2)
    assert layout.stage_sizes == (1, 3, 3, 1)
    assert layout.rank_costs == (3.5, 3.5)
    assert StageLayout.even(8, 2, 2, costs).bottleneck == 4.0


def test_handoff_keeps_the_region_in_the_last_stage_while_that_is_cheaper():
    """Layers 3-5 share (source 2) on 3 ranks: full layers cost 1, sharing ones 0.5. Cutting
    at 3, 4 or 5 sends Q/K along, and then every boundary costs h to each side."""
    modes = layer_modes(6, [3, 4, 5])
    costs = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]
    # h = 0.2: (2,2,2) costs (2.2, 1.9, 1.2) and (2,1,3) (2.2, 1.4, 1.7); the even one wins.
    # Keeping the region in the last stage, (1,1,4), would cost 2.5.
    cheap = balance_layout(costs, 3, modes=modes, handoff_cost=0.2)
    assert cheap.stage_sizes == (2, 2, 2)
    assert cheap.rank_costs == pytest.approx((2.2, 1.9, 1.2))
    # h = 0.6: the best crossing split costs 2.6 ((2,1,3)); (1,1,4) costs 2.5 and sends nothing.
    dear = balance_layout(costs, 3, modes=modes, handoff_cost=0.6)
    assert dear.stage_sizes == (1, 1, 4)
    assert dear.rank_costs == (1.0, 1.0, 2.5)
    # h = 0.5: (2,2,2), (2,1,3) and (1,1,4) all cost 2.5; the one sending nothing wins.
    assert balance_layout(costs, 3, modes=modes, handoff_cost=0.5).stage_sizes == (1, 1, 4)
    # Without modes nothing is known to cross: the hand-off cost is not charged.
    assert balance_layout(costs, 3, handoff_cost=0.6).stage_sizes == (2, 2, 2)


def test_any_hand_off_cost_decides_between_equally_fast_splits():
    # Region 2-3 (source 1): (1,3) costs (1, 2) and sends nothing, (2,2) costs (2, 1) + h.
    modes = layer_modes(4, [2, 3])
    costs = [1.0, 1.0, 0.5, 0.5]
    assert balance_layout(costs, 2, modes=modes).stage_sizes == (2, 2)  # no hand-off cost: even
    assert balance_layout(costs, 2, modes=modes, handoff_cost=1e-3).stage_sizes == (1, 3)


def test_same_inputs_same_layout():
    costs = [1.0] * 20 + [0.83] * 12
    modes = layer_modes(32, range(20, 32))
    options = dict(embedding_cost=0.3, output_cost=0.9, modes=modes, handoff_cost=0.1)
    assert balance_layout(costs, 4, 2, **options) == balance_layout(list(costs), 4, 2, **options)


@pytest.mark.parametrize("v", [1, 2, 4])
def test_7b_like_layouts_are_proven_and_beat_the_even_split(v):
    """32 layers on 8 ranks, every fourth region size of a schedule."""
    costs = LayerCosts(1.0, 0.84, 0.05, 0.65, handoff_p2p=0.1)
    for region in range(0, 32, 4):
        layout = balance_region(costs, 32, range(32 - region, 32), 8, v)
        assert layout.optimal, region
        even = predict_pipeline_speedup(costs, 32, 8, v, region).fixed_bottleneck
        assert layout.bottleneck <= even + 1e-12


def test_out_of_budget_search_returns_a_valid_split():
    costs = [1.0] * 12 + [0.84] * 8
    prefix = [0.0, *itertools.accumulate(costs)]
    offsets = [0.05] + [0.0] * 4 + [0.65]
    exact, proven = best_split(prefix, 2, 3, offsets, [True] * 21)
    cut_short, short_proven = best_split(prefix, 2, 3, offsets, [True] * 21, work_budget=50)
    assert proven and not short_proven
    assert cut_short[-1] == 20 and all(b > a for a, b in zip([0, *cut_short], cut_short))

    def bottleneck(ends):
        sizes = [b - a for a, b in zip([0, *ends], ends)]
        return StageLayout.from_sizes(sizes, 2, 3, costs, 0.05, 0.65).bottleneck

    assert bottleneck(cut_short) >= bottleneck(exact) - 1e-12


# --------------------------------------------------------------------------------------------
# Rejections


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pipeline_parallel_size=0), "--pp"),
        (dict(pipeline_parallel_size=2, virtual_pipeline_parallel_size=0), "--vpp"),
        (dict(pipeline_parallel_size=1, virtual_pipeline_parallel_size=2), "--vpp 2 needs --pp > 1"),
        (dict(pipeline_parallel_size=4, virtual_pipeline_parallel_size=2), r"--pp 4 x --vpp 2 = 8"),
        (dict(pipeline_parallel_size=7), "--pp 7"),
    ],
)
def test_impossible_requests_name_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        balance_layout([1.0] * 6, **kwargs)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_costs_are_rejected(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        balance_layout([1.0, bad, 1.0], 2)
    with pytest.raises(ValueError, match="embedding"):
        balance_layout([1.0, 1.0], 2, embedding_cost=bad)
    with pytest.raises(ValueError, match="hand-off"):
        balance_layout([1.0, 1.0], 2, handoff_cost=bad)


def test_no_layers_and_mismatched_modes_are_rejected():
    with pytest.raises(ConfigError, match="--num-layers"):
        balance_layout([], 2)
    with pytest.raises(ValueError, match="3 layer modes for 4"):
        balance_layout([1.0] * 4, 2, modes=layer_modes(3, [2]))


def test_balance_region_rejects_a_region_that_is_not_a_deep_block():
    with pytest.raises(ConfigError, match="must end at the last layer"):
        balance_region(LayerCosts(1.0, 0.8, 0.0, 0.0), 8, [3, 4], 2)


# --------------------------------------------------------------------------------------------
# Megatron-Core layout strings


@pytest.fixture
def megatron_layout():
    """Megatron-Core's parser, with its VPP world size set as a real run would set it (its
    get_layer_id_list only honours vp_stage when that global is set)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    saved = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    yield PipelineParallelLayerLayout, parallel_state
    parallel_state.set_virtual_pipeline_model_parallel_world_size(saved)


def _assert_megatron_reads(layout: StageLayout, text: str, megatron_layout):
    parser, parallel_state = megatron_layout
    p, v = layout.pipeline_parallel_size, layout.virtual_pipeline_parallel_size
    parsed = parser.from_str(text, p)
    assert parsed.virtual_pipeline_model_parallel_size == v
    assert parsed.validate_layer_layout(num_layers=layout.num_layers, mtp_num_layers=None) is False
    parallel_state.set_virtual_pipeline_model_parallel_world_size(v if v > 1 else None)
    for pp_rank in range(p):
        for vp_stage in range(v):
            ids = parsed.get_layer_id_list(pp_rank=pp_rank, vp_stage=vp_stage)
            assert ids == layout.layer_ids(pp_rank, vp_stage), (text, pp_rank, vp_stage)
            k = vp_stage * p + pp_rank  # Megatron's interleaved order, spelled out
            start = sum(layout.stage_sizes[:k])
            assert ids == list(range(start, start + layout.stage_sizes[k]))
    # The layer types per stage: E opens stage 0, L closes the last one.
    names = [[t.name for t in stage] for row in parsed.layout for stage in row]
    assert parsed.layout[0][0][0].name == "embedding"
    assert parsed.layout[p - 1][v - 1][-1].name == "loss"
    assert sum(stage.count("decoder") for stage in names) == layout.num_layers


def test_layout_string_format():
    assert StageLayout.from_sizes((3, 3, 2), 3).to_layout_string() == "Ettt|ttt|ttL"
    interleaved = StageLayout.from_sizes((1, 2, 3, 4), 2, 2)
    # Virtual stage k = vp_stage * p + pp_rank: rank 0 holds blocks 0 and 2.
    assert interleaved.to_layout_string() == "Et|tt|ttt|ttttL"
    assert interleaved.layer_ids(0, 0) == [0]
    assert interleaved.layer_ids(1, 0) == [1, 2]
    assert interleaved.layer_ids(0, 1) == [3, 4, 5]
    assert interleaved.layer_ids(1, 1) == [6, 7, 8, 9]
    empty_ends = StageLayout.from_sizes((0, 5, 0), 3)
    assert empty_ends.to_layout_string() == "E|ttttt|L"
    even = StageLayout.even(32, 8)
    assert even.to_layout_string(compact=True) == "Et*4|(t*4|)*6,t*4L"


def test_layout_strings_read_back_by_megatron(megatron_layout):
    rng = random.Random(11)
    cases = [StageLayout.from_sizes((3, 3, 2), 3), StageLayout.even(32, 8), StageLayout.even(32, 8, 2)]
    for _ in range(60):
        p = rng.randint(1, 4)
        v = 1 if p == 1 else rng.randint(1, 4)
        sizes = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(p * v)]
        cases.append(StageLayout.from_sizes(sizes, p, v))
    cases.append(StageLayout.from_sizes([4] * 8 + [0] * 3 + [4] * 5, 4, 4))
    for layout in cases:
        if layout.num_layers == 0:
            continue
        for compact in (False, True):
            text = layout.to_layout_string(compact=compact)
            _assert_megatron_reads(layout, text, megatron_layout)
            back = StageLayout.from_layout_string(text, layout.pipeline_parallel_size)
            assert back.stage_sizes == layout.stage_sizes
            assert back.virtual_pipeline_parallel_size == layout.virtual_pipeline_parallel_size


def test_balanced_layouts_read_back_by_megatron(megatron_layout):
    costs = LayerCosts(1.0, 0.8, 0.3, 1.2, handoff_p2p=0.1)
    for p, v in [(2, 1), (4, 1), (8, 1), (4, 2), (8, 2), (2, 4)]:
        layout = balance_region(costs, 32, range(24, 32), p, v)
        for compact in (False, True):
            _assert_megatron_reads(layout, layout.to_layout_string(compact), megatron_layout)


def test_megatron_transformer_config_takes_the_layout():
    """The string goes to TransformerConfig.pipeline_model_parallel_layout, which derives the VPP
    size from it (and refuses num_layers_in_first/last_pipeline_stage and
    account_for_embedding/loss_in_pipeline_split next to it)."""
    import torch

    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = balance_layout([1.0] * 6 + [0.8] * 6, 2, 2, embedding_cost=0.5, output_cost=1.0)
    common = dict(
        num_layers=12,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    config = TransformerConfig(pipeline_model_parallel_layout=layout.to_layout_string(), **common)
    assert config.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="cannot be set"):
        TransformerConfig(
            pipeline_model_parallel_layout=layout.to_layout_string(),
            num_layers_in_first_pipeline_stage=3,
            **common,
        )


@pytest.mark.parametrize(
    "text, p, match",
    [
        ("Ettt|tttL", 3, "does not divide"),
        ("ttt|EtttL", 2, "'E' opening"),
        ("Ettt|tLtt", 2, "'L' "),
        ("Ettt|tmL", 2, "only decoder"),
        ("Ettx|ttL", 2, "Invalid layer character"),
        ("Ettt|tttL", 0, "--pp"),
    ],
)
def test_from_layout_string_rejects(text, p, match):
    with pytest.raises(ConfigError, match=match):
        StageLayout.from_layout_string(text, p)


# --------------------------------------------------------------------------------------------
# StageLayout


def test_stage_layout_costs():
    layout = StageLayout.from_sizes((1, 2, 2, 1), 2, 2, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.5, 0.25)
    assert layout.virtual_stage_costs == (1.5, 5.0, 9.0, 6.25)
    assert layout.rank_costs == (10.5, 11.25)
    assert layout.bottleneck == 11.25
    # A boundary cost goes to both sides of each of the 3 boundaries: 1, 2, 2, 1 times.
    charged = StageLayout.from_sizes((1, 2, 2, 1), 2, 2, [1.0] * 6, boundary_cost=0.5)
    assert charged.virtual_stage_costs == (1.5, 3.0, 3.0, 1.5)
    with pytest.raises(ValueError, match="no costs"):
        StageLayout.from_sizes((3, 3), 2).bottleneck
    with pytest.raises(ValueError, match="4 stage sizes"):
        StageLayout((1, 1, 1, 1), 3)
    with pytest.raises(IndexError):
        layout.layer_ids(2, 0)


def test_even_layout_spreads_the_remainder_over_the_first_stages():
    assert StageLayout.even(10, 4).stage_sizes == (3, 3, 2, 2)
    assert StageLayout.even(32, 4, 2).stage_sizes == (4,) * 8


# --------------------------------------------------------------------------------------------
# Reports and predictions

TINY = LayerCosts(compute_layer=1.0, share_layer=0.5, embedding=0.0, output_layer=0.0, handoff_p2p=0.25)
"""Round numbers for hand-computed layouts."""


def test_predict_pipeline_speedup_by_hand():
    """6 layers on 2 ranks, the deepest 3 sharing (source: layer 2). Baseline (3,3): 3 each.
    Even split with sharing: the cut at 3 starts the region, so both sides pay 0.25: 3.25.
    Planned: (2,4) keeps the region off the boundary, 2 and 1 + 1.5 = 2.5. Totals 6 and 4.5."""
    speedup = predict_pipeline_speedup(TINY, 6, 2, 1, region_size=3)
    assert isinstance(speedup, PipelineSpeedup)
    assert speedup.baseline_bottleneck == 3.0
    assert speedup.baseline_rebalanced_bottleneck == 3.0
    assert speedup.fixed_bottleneck == 3.25
    assert speedup.rebalanced_bottleneck == 2.5
    assert speedup.speedup_without_rebalancing == pytest.approx(3 / 3.25)
    assert speedup.speedup_with_rebalancing == pytest.approx(1.2)
    assert speedup.speedup_over_rebalanced_baseline == pytest.approx(1.2)
    assert speedup.ideal_speedup == pytest.approx(6 / 4.5)
    with pytest.raises(ConfigError, match="region size"):
        predict_pipeline_speedup(TINY, 6, 2, 1, region_size=6)


def test_format_layouts_reports_layers_costs_and_gains():
    text = format_layouts(TINY, 6, 2, 1, [(0, []), (100, [3, 4, 5])])
    assert "6 layers, --pp 2 --vpp 1; baseline (no sharing, even split) bottleneck 3" in text
    assert "iteration 0: 0 sharing layers (none)" in text
    assert "iteration 100: 3 sharing layers (3-5)\n" in text  # (2,4) keeps Q/K on one stage
    assert text.count("--pipeline-model-parallel-layout") == 2
    assert "--pipeline-model-parallel-layout Ett|t*4L" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    # rank, layers, cost, even-split cost (hand-computed as in the prediction test)
    assert rows == [
        ["0", "0-2", "3", "3"],
        ["1", "3-5", "3", "3"],
        ["0", "0-1", "2", "3.25"],
        ["1", "2-5", "2.5", "1.75"],
    ]
    assert "bottleneck 2.5 (even split 3.25); speedup vs baseline: rebal 1.200x, fixed 0.923x" in text


def test_format_layouts_says_when_qk_cross_a_stage():
    # 8 layers on 4 ranks with layers 2-7 sharing: no split keeps them (and layer 1) together.
    text = format_layouts(TINY, 8, 4, 1, [(0, range(2, 8))])
    assert "6 sharing layers (2-7); Q/K cross a stage boundary" in text


# --------------------------------------------------------------------------------------------
# --epas-exclude-last: a region that ends before the last layer (computing layers after it)


@pytest.mark.parametrize("p, v", [(2, 1), (3, 1), (2, 2)])
def test_region_with_a_computing_tail_matches_brute_force(p, v):
    """A boundary after the region (before the computing tail) carries no hand-off; one inside
    it does -- the brute force prices every split by that rule."""
    rng = random.Random(500 + 10 * p + v)
    for _ in range(40):
        n = rng.randint(p * v, 10)
        exclude_last = rng.randint(1, n - 2) if n > 2 else 1
        region = rng.randint(1, n - 1 - exclude_last) if n - 1 - exclude_last >= 1 else 0
        end = n - 1 - exclude_last
        modes = layer_modes(n, range(end + 1 - region, end + 1), exclude_last=exclude_last)
        assert modes[end + 1:] == [LayerMode.COMPUTE] * exclude_last
        costs = [0.5 if mode == LayerMode.SHARE else 1.0 for mode in modes]
        _check(costs, p, v, rng.choice([0.0, 0.3]), rng.choice([0.0, 0.65]), modes, rng.choice([0.05, 0.3, 5.0]))


def test_balance_region_and_reports_with_a_computing_tail_by_hand():
    """6 layers on 2 ranks, layers 3-4 share (source 2), layer 5 computes: costs
    1, 1, 1, 0.5, 0.5, 1. The even split (3,3) cuts before layer 3, the region's start:
    3 + 0.25 and 2 + 0.25. (2,4) cuts before the source and sends nothing: 2 and 3."""
    assert layer_modes(6, [3, 4], exclude_last=1) == ["compute", "compute", "source", "share", "share", "compute"]
    layout = balance_region(TINY, RegionShape(6, exclude_last=1), [3, 4], 2)
    assert layout.stage_sizes == (2, 4) and layout.rank_costs == (2.0, 3.0)
    with pytest.raises(ConfigError, match="--epas-exclude-last"):
        balance_region(TINY, 6, [3, 4], 2)  # the default region must include the last layer
    speedup = predict_pipeline_speedup(TINY, RegionShape(6, exclude_last=1), 2, 1, region_size=2)
    assert speedup.fixed_bottleneck == 3.25 and speedup.rebalanced_bottleneck == 3.0
    assert speedup.ideal_speedup == pytest.approx(6 / 5)
    text = format_layouts(TINY, RegionShape(6, exclude_last=1), 2, 1, [(0, []), (100, [3, 4])])
    assert "iteration 100: 2 sharing layers (3-4)\n" in text  # no crossing note
    assert "bottleneck 3 (even split 3.25)" in text
    # A boundary right after the region sends nothing: layers 1-3 share, (4, 2) cuts before 4.
    after = balance_region(LayerCosts(1.0, 0.5, 0.0, 0.0, 100.0), RegionShape(6, exclude_last=2), [1, 2, 3], 2)
    assert after.stage_sizes == (4, 2) and after.rank_costs == (2.5, 2.0)
