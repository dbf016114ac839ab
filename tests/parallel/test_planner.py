"""Pipeline-stage planner: optimality against brute force, tie-breaking, Megatron layout strings,
schedules and speed on 7B-like shapes."""

import itertools
import math
import random
import time

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.parallel.cost_model import LayerCosts, costs_for_modes
from epas_megatron.parallel.planner import (
    PipelineSpeedup,
    StageLayout,
    format_plan,
    plan_layout,
    plan_schedule,
    predict_pipeline_speedup,
    sharing_spans,
)

# --------------------------------------------------------------------------------------------
# Brute force: every contiguous split, the planner's objective spelled out


def _splits(n, num_stages, min_layers):
    """All stage-size tuples (each >= min_layers, summing to n), in lexicographic order."""
    free = n - num_stages * min_layers
    if free < 0:
        return
    # Stars and bars over the free layers: cut positions among free + num_stages - 1 slots.
    for bars in itertools.combinations(range(free + num_stages - 1), num_stages - 1):
        sizes, previous = [], -1
        for bar in (*bars, free + num_stages - 1):
            sizes.append(bar - previous - 1 + min_layers)
            previous = bar
        yield tuple(sizes)


def _brute_force(costs, p, v=1, emb=0.0, out=0.0, current=None, min_layers=1, keep=()):
    """(bottleneck, sizes) chosen by the planner's rules: smallest bottleneck (ties within 1e-9
    of the total), then fewest layers moved from `current`, then fewest moved from the even
    split, then the smallest stage ends listed rank by rank."""
    n, num_stages = len(costs), p * v
    prefix = [0.0, *itertools.accumulate(costs)]
    forbidden = {cut for first, last in keep for cut in range(first + 1, last + 1)}
    even_owner = _owners(StageLayout.even(n, p, v).stage_sizes)
    current_owner = None if current is None else _owners(current.stage_sizes)
    scored = []
    for sizes in _splits(n, num_stages, min_layers):
        ends = list(itertools.accumulate(sizes))
        if any(end in forbidden for end in ends):
            continue
        ranks, start = [0.0] * p, 0
        for k, end in enumerate(ends):
            ranks[k % p] += prefix[end] - prefix[start]
            start = end
        ranks[0] += emb
        ranks[-1] += out
        scored.append((max(ranks), sizes))
    if not scored:
        return None
    best = min(value for value, _ in scored)
    tol = 1e-9 * (prefix[-1] + emb + out)
    tied = [sizes for value, sizes in scored if value <= best + tol]

    def key(sizes):
        owner = _owners(sizes)
        moved = 0 if current_owner is None else sum(a != b for a, b in zip(owner, current_owner))
        ends = list(itertools.accumulate(sizes))
        rank_major = [ends[k] for k in sorted(range(num_stages), key=lambda k: (k % p, k // p))]
        return moved, sum(a != b for a, b in zip(owner, even_owner)), rank_major

    return best, min(tied, key=key)


def _owners(sizes):
    return [k for k, size in enumerate(sizes) for _ in range(size)]


def _check_against_brute_force(costs, p, v=1, emb=0.0, out=0.0, current=None, min_layers=1, keep=()):
    expected = _brute_force(costs, p, v, emb, out, current, min_layers, keep)
    layout = plan_layout(
        costs,
        p,
        v,
        embedding_cost=emb,
        output_cost=out,
        current=current,
        min_layers_per_stage=min_layers,
        keep_together=keep,
    )
    assert layout.optimal and layout.ties_resolved
    context = (costs, p, v, emb, out, current and current.stage_sizes, min_layers, keep)
    assert layout.bottleneck == pytest.approx(expected[0], rel=1e-12, abs=1e-12), context
    assert layout.stage_sizes == expected[1], context
    assert layout.bottleneck_lower_bound == layout.bottleneck
    if current is not None:
        assert layout.moved_layers == layout.moves_from(current)
    return layout


def _cost_vectors(n, rng):
    """Integer costs (many exact ties), uniform costs, random floats, an EPAS-like profile."""
    yield [float(rng.randint(0, 4)) for _ in range(n)]
    yield [1.0] * n
    yield [rng.uniform(0.1, 2.0) for _ in range(n)]
    region = rng.randint(0, n - 1)
    yield [1.0] * (n - region) + [0.8] * region


# --------------------------------------------------------------------------------------------
# Optimality


@pytest.mark.parametrize("p", [2, 3, 4])
def test_single_chunk_matches_brute_force_for_all_small_models(p):
    rng = random.Random(p)
    for n in range(p, 11):
        for costs in _cost_vectors(n, rng):
            for emb, out in [(0.0, 0.0), (1.0, 2.0), (rng.uniform(0, 3), rng.uniform(0, 3))]:
                _check_against_brute_force(costs, p, 1, emb, out)


def test_single_stage_is_the_whole_model():
    layout = plan_layout([1.0, 2.0, 3.0], 1, embedding_cost=0.5, output_cost=0.25)
    assert layout.stage_sizes == (3,)
    assert layout.bottleneck == pytest.approx(6.75)
    assert layout.to_layout_string() == "EtttL"


@pytest.mark.parametrize("p, v, max_layers", [(2, 2, 10), (3, 2, 10), (2, 3, 10), (4, 2, 10)])
def test_interleaved_matches_brute_force(p, v, max_layers):
    rng = random.Random(10 * p + v)
    for n in range(p * v, max_layers + 1):
        for costs in _cost_vectors(n, rng):
            for emb, out in [(0.0, 0.0), (1.0, 2.0), (rng.uniform(0, 3), rng.uniform(0, 3))]:
                _check_against_brute_force(costs, p, v, emb, out)


def test_matches_brute_force_with_a_current_layout_to_stay_close_to():
    rng = random.Random(7)
    for _ in range(120):
        p = rng.choice([2, 3, 4])
        v = rng.choice([1, 1, 2]) if p < 4 else 1
        n = rng.randint(p * v, 10)
        costs = [float(rng.randint(0, 3)) for _ in range(n)]
        current = StageLayout.from_sizes(rng.choice(list(_splits(n, p * v, 1))), p, v)
        _check_against_brute_force(costs, p, v, rng.randint(0, 2), rng.randint(0, 2), current)


def test_matches_brute_force_with_empty_stages_allowed():
    rng = random.Random(3)
    for _ in range(80):
        p, v = rng.choice([(2, 1), (3, 1), (4, 1), (2, 2), (3, 2)])
        n = rng.randint(1, 8)
        costs = [float(rng.randint(0, 4)) for _ in range(n)]
        layout = _check_against_brute_force(
            costs, p, v, rng.randint(0, 6), rng.randint(0, 6), min_layers=0
        )
        assert layout.num_layers == n


def test_matches_brute_force_with_spans_kept_together():
    rng = random.Random(5)
    for _ in range(80):
        p, v = rng.choice([(2, 1), (3, 1), (2, 2)])
        n = rng.randint(p * v + 1, 10)
        first = rng.randrange(n - 1)
        keep = [(first, rng.randint(first + 1, min(n - 1, first + 2)))]
        if _brute_force([1.0] * n, p, v, keep=keep) is None:
            continue
        costs = [float(rng.randint(0, 4)) for _ in range(n)]
        layout = _check_against_brute_force(costs, p, v, 1.0, 1.0, keep=keep)
        cuts = set(itertools.accumulate(layout.stage_sizes))
        assert not cuts & set(range(keep[0][0] + 1, keep[0][1] + 1))


def test_embedding_and_output_costs_shift_layers_off_the_end_ranks():
    layout = plan_layout([1.0] * 8, 4, embedding_cost=1.0, output_cost=2.0)
    # (2, 3, 2, 1) is as fast; (2, 2, 3, 1) is one layer nearer the even split.
    assert layout.stage_sizes == (2, 2, 3, 1)
    assert layout.rank_costs == (3.0, 2.0, 3.0, 3.0)


# --------------------------------------------------------------------------------------------
# Tie-breaking


def test_ties_go_to_the_fewest_moved_layers():
    # 5 equal layers on 2 ranks: (2, 3) and (3, 2) are equally fast.
    costs = [1.0] * 5
    assert plan_layout(costs, 2).stage_sizes == (3, 2)  # no current: nearest the even split
    from_one_four = StageLayout.from_sizes((1, 4), 2)
    layout = plan_layout(costs, 2, current=from_one_four)
    assert layout.stage_sizes == (2, 3)  # moves 1 layer; (3, 2) would move 2
    assert layout.moved_layers == 1


def test_equally_fast_current_layout_is_kept():
    costs = [1.0] * 8
    assert plan_layout(costs, 2, 2).stage_sizes == (2, 2, 2, 2)
    lopsided = StageLayout.from_sizes((1, 3, 3, 1), 2, 2)  # ranks hold 4 layers each too
    layout = plan_layout(costs, 2, 2, current=lopsided)
    assert layout.stage_sizes == (1, 3, 3, 1)
    assert layout.moved_layers == 0


def test_a_switch_moves_few_layers():
    """Deep layers turn cheap: the planner shifts the boundary by what balance needs."""
    n, p = 16, 4
    before = plan_layout([1.0] * n, p)
    assert before.stage_sizes == (4, 4, 4, 4)
    after = plan_layout([1.0] * 8 + [0.5] * 8, p, current=before)
    assert after.stage_sizes == (3, 3, 4, 6)
    assert after.rank_costs == (3.0, 3.0, 3.0, 3.0)
    assert after.moved_layers == 5
    expected = _brute_force([1.0] * 8 + [0.5] * 8, p, current=before)
    assert after.stage_sizes == expected[1]


def test_same_inputs_same_layout():
    costs = [1.0] * 20 + [0.83] * 12
    first = plan_layout(costs, 4, 2, embedding_cost=0.3, output_cost=0.9)
    second = plan_layout(list(costs), 4, 2, embedding_cost=0.3, output_cost=0.9)
    assert first == second


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
        (
            dict(pipeline_parallel_size=2, min_layers_per_stage=4),
            "need at least 8 decoder layers",
        ),
        (dict(pipeline_parallel_size=2, keep_together=[(0, 5)]), "keeps the spans"),
    ],
)
def test_impossible_requests_name_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_layout([1.0] * 6, **kwargs)


def test_more_stages_than_layers_is_fine_with_empty_stages():
    layout = plan_layout([1.0] * 3, 4, 2, min_layers_per_stage=0)
    assert layout.num_layers == 3 and layout.bottleneck == 1.0


def test_current_layout_of_another_shape_is_rejected():
    with pytest.raises(ConfigError, match="--pipeline-layout"):
        plan_layout([1.0] * 6, 2, current=StageLayout.from_sizes((2, 2, 2), 3))


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_costs_are_rejected(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        plan_layout([1.0, bad, 1.0], 2)
    with pytest.raises(ValueError, match="embedding"):
        plan_layout([1.0, 1.0], 2, embedding_cost=bad)


def test_no_layers_is_rejected():
    with pytest.raises(ConfigError, match="--num-layers"):
        plan_layout([], 2)


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
            assert ids == list(range(len(layout.assignment())))[
                slice(
                    sum(layout.stage_sizes[: layout.virtual_stage(pp_rank, vp_stage)]),
                    sum(layout.stage_sizes[: layout.virtual_stage(pp_rank, vp_stage) + 1]),
                )
            ]
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
    assert interleaved.assignment()[:4] == ((0, 0), (1, 0), (1, 0), (0, 1))
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


def test_planned_layouts_read_back_by_megatron(megatron_layout):
    costs = [1.0] * 24 + [0.8] * 8
    for p, v in [(2, 1), (4, 1), (8, 1), (4, 2), (8, 2), (2, 4)]:
        layout = plan_layout(costs, p, v, embedding_cost=0.3, output_cost=1.2)
        for compact in (False, True):
            _assert_megatron_reads(layout, layout.to_layout_string(compact), megatron_layout)


def test_megatron_transformer_config_takes_the_layout():
    """The string goes to TransformerConfig.pipeline_model_parallel_layout, which derives the VPP
    size from it (and refuses num_layers_in_first/last_pipeline_stage and
    account_for_embedding/loss_in_pipeline_split next to it)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = plan_layout([1.0] * 6 + [0.8] * 6, 2, 2, embedding_cost=0.5, output_cost=1.0)
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


def test_stage_layout_costs_and_moves():
    layout = StageLayout.from_sizes((1, 2, 2, 1), 2, 2, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.5, 0.25)
    assert layout.virtual_stage_costs == (1.5, 5.0, 9.0, 6.25)
    assert layout.rank_costs == (10.5, 11.25)
    assert layout.bottleneck == 11.25
    assert layout.moves_from(StageLayout.from_sizes((2, 1, 2, 1), 2, 2)) == 1
    with pytest.raises(ValueError, match="different shapes"):
        layout.moves_from(StageLayout.from_sizes((3, 3), 2))
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
# Schedules, reports, predictions

COSTS_7B = LayerCosts(compute_layer=1.0, share_layer=0.84, embedding=0.05, output_layer=0.65)
"""7B-like relative costs: a sharing layer skips its Q/K projections; the output layer is about
two thirds of a layer (32k vocabulary)."""


def _schedule(num_layers, steps, every=1000):
    """Sharing regions growing from the deepest layer: (iteration, sharing layers)."""
    return [(i * every, list(range(num_layers - size, num_layers))) for i, size in enumerate(steps)]


def test_plan_schedule_breaks_ties_toward_the_previous_layout():
    schedule = _schedule(32, [0, 4, 8, 12, 16])
    plan = plan_schedule(COSTS_7B, 32, 4, 1, schedule)
    assert [iteration for iteration, _ in plan] == [0, 1000, 2000, 3000, 4000]
    previous = None
    for (iteration, sharing), (_, layout) in zip(schedule, plan):
        modes = ["share" if layer in sharing else "compute" for layer in range(32)]
        costs = costs_for_modes(COSTS_7B, modes)
        expected = plan_layout(
            costs,
            4,
            embedding_cost=COSTS_7B.embedding,
            output_cost=COSTS_7B.output_layer,
            current=previous,
        )
        assert layout == expected
        assert layout.bottleneck <= StageLayout.even(32, 4, 1, costs, 0.05, 0.65).bottleneck
        previous = layout
    # The even split stays best (and is kept, nothing moves) until the region reaches rank 2;
    # then ranks 2 and 3, cheaper now, take layers from rank 0, which also holds the embedding.
    assert [layout.stage_sizes for _, layout in plan[:4]] == [(8, 8, 8, 8)] * 4
    assert [layout.moved_layers for _, layout in plan] == [0, 0, 0, 0, 2]
    assert plan[-1][1].stage_sizes == (7, 8, 9, 8)
    assert plan[-1][1].bottleneck < plan[0][1].bottleneck


def test_plan_schedule_can_keep_sources_with_their_sharers():
    schedule = [(0, []), (100, [5, 6, 7, 12, 13])]
    plan = plan_schedule(COSTS_7B, 16, 4, 1, schedule, keep_sources_together=True)
    cuts = set(itertools.accumulate(plan[-1][1].stage_sizes))
    assert sharing_spans(16, [5, 6, 7, 12, 13]) == [(4, 7), (11, 13)]
    assert not cuts & {5, 6, 7, 12, 13}


def test_plan_schedule_rejects_unordered_iterations_and_bad_layers():
    with pytest.raises(ValueError, match="must increase"):
        plan_schedule(COSTS_7B, 8, 2, 1, [(10, []), (10, [7])])
    with pytest.raises(ValueError, match="outside"):
        plan_schedule(COSTS_7B, 8, 2, 1, [(0, [8])])
    with pytest.raises(ValueError, match="layer 0 cannot share"):
        plan_schedule(COSTS_7B, 8, 2, 1, [(0, [0, 1])])
    with pytest.raises(ValueError, match="no source"):
        sharing_spans(8, [0, 1])


def test_format_plan_reports_layers_costs_and_gains():
    schedule = _schedule(16, [0, 4, 8])
    text = format_plan(COSTS_7B, 16, 4, 2, schedule)
    assert "16 layers, --pp 4 --vpp 2" in text
    for iteration in (0, 1000, 2000):
        assert f"iteration {iteration}:" in text
    assert "sharing layers (12-15)" in text
    assert text.count("--pipeline-model-parallel-layout") == 3
    assert "speedup vs baseline: rebal" in text
    # One row per rank per switch: rank, its chunks' layer ranges, costs.
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 3 * 4
    assert rows[0][:2] == ["0", "0-1,8-9"]


def test_predict_pipeline_speedup():
    no_region = predict_pipeline_speedup(COSTS_7B, 32, 4, 1, region_size=0)
    assert isinstance(no_region, PipelineSpeedup)
    assert no_region.speedup_without_rebalancing == pytest.approx(1.0)
    assert no_region.ideal_speedup == pytest.approx(1.0)
    assert no_region.speedup_with_rebalancing >= 1.0

    half = predict_pipeline_speedup(COSTS_7B, 32, 4, 1, region_size=16)
    # Without rebalancing the first ranks (all compute layers) still set the pace.
    assert half.speedup_without_rebalancing == pytest.approx(
        half.baseline_bottleneck / half.fixed_bottleneck
    )
    assert half.fixed_bottleneck == pytest.approx(8 * 1.0 + 0.05)
    assert half.speedup_with_rebalancing > half.speedup_without_rebalancing
    assert half.rebalanced_bottleneck <= half.fixed_bottleneck
    assert half.speedup_over_rebalanced_baseline <= half.ideal_speedup + 1e-9
    with pytest.raises(ConfigError, match="region size"):
        predict_pipeline_speedup(COSTS_7B, 32, 4, 1, region_size=32)


# --------------------------------------------------------------------------------------------
# Speed on 7B-like shapes


@pytest.mark.parametrize("v", [1, 2])
def test_7b_like_plans_are_fast_and_proven(v):
    """32 layers on 8 pipeline ranks, every region size of a schedule, with the previous layout
    to stay close to: each plan well under a second, proven optimal, ties resolved."""
    previous, slowest = None, 0.0
    for region in range(0, 32, 4):
        costs = [1.0] * (32 - region) + [0.84] * region
        start = time.perf_counter()
        layout = plan_layout(costs, 8, v, embedding_cost=0.05, output_cost=0.65, current=previous)
        slowest = max(slowest, time.perf_counter() - start)
        assert layout.optimal and layout.ties_resolved, region
        assert layout.bottleneck <= StageLayout.even(32, 8, v, costs, 0.05, 0.65).bottleneck
        previous = layout
    assert slowest < 0.5


def test_large_shapes_stay_within_the_budget():
    """80 layers, p = 8, v = 4: a result within about a second even if it cannot be proven
    optimal, with a lower bound saying how far off it can be."""
    costs = [1.0] * 40 + [0.83] * 40
    start = time.perf_counter()
    layout = plan_layout(costs, 8, 4, embedding_cost=0.3, output_cost=0.6)
    assert time.perf_counter() - start < 2.5
    assert layout.bottleneck_lower_bound <= layout.bottleneck
    assert layout.bottleneck <= StageLayout.even(80, 8, 4, costs, 0.3, 0.6).bottleneck
    assert layout.bottleneck <= layout.bottleneck_lower_bound * 1.02
