"""Stage rebalancing under V placement (Qi et al., "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024: 2p stages, stage s on rank s and on rank 2p-1-s, embedding, LM head and
loss on rank 0, the turn on rank p-1 handed on locally): the balancer against a brute-force
enumeration of every V split priced and ranked by the documented rules, hand-computed layouts and
prices, the V layout string, the start-up table. No processes."""

import itertools
import random

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.model.stage_layout import VStageLayout
from epas_megatron.parallel.balancer import balance_layout, balance_v_layout, balance_v_region
from epas_megatron.parallel.cost_model import LayerCosts
from epas_megatron.parallel.layout_report import even_layout, format_layouts
from epas_megatron.parallel.partition import best_split
from epas_megatron.sharing.shape import LayerMode, layer_modes

# --------------------------------------------------------------------------------------------
# Brute force: every V split, priced and ranked spelled out


def _splits(n, num_stages):
    """All stage-size tuples (each >= 1, summing to n)."""
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))


def _holder(stage, p):
    """The rank holding V stage ``stage``: down the ranks, then back up."""
    return stage if stage < p else 2 * p - 1 - stage


def _rank_costs(sizes, costs, p, emb, out, modes=None, handoff=0.0):
    """Each rank's cost: its two stages' layers; the embedding and the output layer on rank 0;
    when some stage boundary lies just before a sharing layer, `handoff` to both ranks at every
    boundary between two different ranks (the turn, stage p-1 -> p, stays on rank p-1)."""
    ends = list(itertools.accumulate(sizes))
    starts = [0, *ends[:-1]]
    ranks = [0.0] * p
    for stage in range(2 * p):
        ranks[_holder(stage, p)] += sum(costs[starts[stage]:ends[stage]])
    ranks[0] += emb + out
    crosses = modes is not None and any(e < len(costs) and modes[e] == LayerMode.SHARE for e in ends)
    if crosses:
        for stage in range(1, 2 * p):
            sender, receiver = _holder(stage - 1, p), _holder(stage, p)
            if sender != receiver:
                ranks[sender] += handoff
                ranks[receiver] += handoff
    return ranks, crosses


def _even_sizes(n, p):
    """n layers over 2p stages, the first n % 2p one layer longer."""
    return tuple(n // (2 * p) + (s < n % (2 * p)) for s in range(2 * p))


def _tie_key(sizes, p, crosses, handoff):
    """No hand-off traffic first (when it costs anything), then the sum of |stage end - even
    split's stage end|, then, rank by rank, (end of its first stage, the turn plus the layers of
    the second half the ranks up to it hold): fewer layers on early ranks."""
    ends = list(itertools.accumulate(sizes))
    even = list(itertools.accumulate(_even_sizes(sum(sizes), p)))
    turn = ends[p - 1]
    ranks = tuple((ends[r], turn + sum(sizes[2 * p - 1 - q] for q in range(r + 1))) for r in range(p))
    return crosses and handoff > 0, sum(abs(a - b) for a, b in zip(ends, even)), ranks


def _brute_force(costs, p, emb=0.0, out=0.0, modes=None, handoff=0.0, fits=None):
    n = len(costs)
    scored = []
    for sizes in _splits(n, 2 * p):
        if fits is not None and not fits(sizes):
            continue
        ranks, crosses = _rank_costs(sizes, costs, p, emb, out, modes, handoff)
        scored.append((max(ranks), _tie_key(sizes, p, crosses, handoff), sizes))
    best = min(value for value, _, _ in scored)
    tol = 1e-9 * (sum(costs) + emb + out)
    return best, min((entry for entry in scored if entry[0] <= best + tol), key=lambda entry: entry[1])[2]


def _check(costs, p, emb=0.0, out=0.0, modes=None, handoff=0.0):
    expected_bottleneck, expected_sizes = _brute_force(costs, p, emb, out, modes, handoff)
    layout = balance_v_layout(costs, p, embedding_cost=emb, output_cost=out, modes=modes, handoff_cost=handoff)
    context = (costs, p, emb, out, modes, handoff)
    assert layout.optimal
    assert layout.bottleneck == pytest.approx(expected_bottleneck, rel=1e-12, abs=1e-12), context
    assert layout.stage_sizes == expected_sizes, context
    ranks, _ = _rank_costs(layout.stage_sizes, costs, p, emb, out, modes, handoff)
    assert layout.rank_costs == pytest.approx(ranks, rel=1e-12, abs=1e-12)


def _cost_vectors(n, rng):
    """Integer costs (many exact ties), uniform costs, random floats, an EPAS-like profile."""
    yield [float(rng.randint(0, 4)) for _ in range(n)]
    yield [1.0] * n
    yield [rng.uniform(0.1, 2.0) for _ in range(n)]
    region = rng.randint(0, n - 1)
    yield [1.0] * (n - region) + [0.8] * region


@pytest.mark.parametrize("p", [2, 3])
def test_v_split_matches_brute_force(p):
    rng = random.Random(p)
    for n in range(2 * p, 11 if p == 2 else 10):
        for costs in _cost_vectors(n, rng):
            for emb, out in [(0.0, 0.0), (1.0, 2.0), (rng.uniform(0, 3), rng.uniform(0, 3))]:
                _check(costs, p, emb, out)


@pytest.mark.parametrize("p", [2, 3])
def test_v_handoff_cost_matches_brute_force(p):
    """EPAS regions with a hand-off cost from negligible to dominant."""
    rng = random.Random(100 + p)
    for _ in range(60):
        n = rng.randint(2 * p, 10 if p == 2 else 9)
        region = rng.randint(1, n - 1)
        modes = layer_modes(n, range(n - region, n))
        costs = [rng.choice([0.5, 0.84]) if mode == LayerMode.SHARE else 1.0 for mode in modes]
        handoff = rng.choice([0.0, 0.05, 0.3, 1.0, 5.0])
        _check(costs, p, rng.choice([0.0, 0.3]), rng.choice([0.0, 0.65, 2.0]), modes, handoff)


def test_v_split_with_a_rank_constraint_matches_brute_force():
    """``fits`` sees each rank's two chunks in layer order: here a cap on the layers of each rank
    and on the deep chunk of rank 0 (only feasible splits count)."""
    rng = random.Random(7)
    for _ in range(40):
        p = rng.choice([2, 3])
        n = rng.randint(2 * p, 9)
        costs = [rng.uniform(0.1, 2.0) for _ in range(n)]
        caps = [rng.randint(2, n - 2 * p + 2) for _ in range(p)]
        deep_cap = rng.randint(1, 3)

        def fits(rank, starts, ends):
            assert starts[0] < ends[0] <= starts[1] < ends[1]  # chunk 0 before chunk 1, in layer order
            held = sum(b - a for a, b in zip(starts, ends))
            return held <= caps[rank] and (rank or ends[1] - starts[1] <= deep_cap)

        def fits_sizes(sizes):
            bounds = [0, *itertools.accumulate(sizes)]
            return all(fits(r, (bounds[r], bounds[2 * p - 1 - r]), (bounds[r + 1], bounds[2 * p - r])) for r in range(p))

        if not any(fits_sizes(sizes) for sizes in _splits(n, 2 * p)):
            continue
        _, expected = _brute_force(costs, p, 0.5, 1.0, fits=fits_sizes)
        prefix = [0.0, *itertools.accumulate(costs)]
        offsets = [0.5] + [0.0] * (2 * p - 2) + [1.0]
        ends, proven = best_split(prefix, p, 2, offsets, [True] * (n + 1), fits=fits, placement="v")
        assert proven and ends == list(itertools.accumulate(expected)), (costs, caps, deep_cap)


# --------------------------------------------------------------------------------------------
# By hand


def test_v_placement_keeps_the_even_split_where_1f1b_must_move():
    """Layers 4-7 of 8 at half cost (a deep region; no hand-off cost): 6 in all. V pairs a shallow
    and a deep stage on each rank, so the even V split is already 3 | 3 (rank 0: layers 0-1 and
    6-7, rank 1: 2-3 and 4-5); 1F1B's even split is 4 | 2 and must move a layer."""
    costs = [1.0] * 4 + [0.5] * 4
    v = balance_v_layout(costs, 2)
    assert v.stage_sizes == (2, 2, 2, 2) and v.rank_costs == (3.0, 3.0)
    assert balance_layout(costs, 2).stage_sizes == (3, 5)


def test_the_lm_head_on_rank_0_moves_layers_to_rank_1():
    """8 unit layers, output layer + loss 2 on rank 0: 10 in all, 5 per rank needs 3 layers on
    rank 0 (stages 0 and 3) and 5 on rank 1. (1,3,2,2) and (2,2,3,1) are both 1 from the even
    ends (2,4,6,8); the first holds fewer layers in rank 0's first stage."""
    layout = balance_v_layout([1.0] * 8, 2, output_cost=2.0)
    assert layout.stage_sizes == (1, 3, 2, 2) and layout.rank_costs == (5.0, 5.0)
    assert layout.layer_ids(0, 0) == [0] and layout.layer_ids(0, 1) == [6, 7]
    assert layout.layer_ids(1, 0) == [1, 2, 3] and layout.layer_ids(1, 1) == [4, 5]


def test_the_turn_is_not_charged_for_the_hand_off():
    """Six unit stages over 3 ranks, each boundary costing h = 0.25 to both sides, except the turn
    (stage 2 -> 3, both on rank 2): rank 0 (stages 0, 5) has one boundary per stage, rank 1
    (stages 1, 4) two per stage, rank 2 (stages 2, 3) one per stage."""
    layout = VStageLayout.from_sizes((1,) * 6, 3, [1.0] * 6, boundary_cost=0.25)
    assert layout.virtual_stage_costs == (1.25, 1.5, 1.25, 1.25, 1.5, 1.25)
    assert layout.rank_costs == (2.5, 3.0, 2.5)
    assert [VStageLayout.p2p_boundary(s, 3) for s in range(1, 6)] == [True, True, False, True, True]


@pytest.mark.parametrize("handoff, sizes", [(0.2, (2, 2, 1, 1)), (0.25, (1, 1, 1, 3)), (0.3, (1, 1, 1, 3))])
def test_hand_off_keeps_the_region_in_one_stage_while_that_is_cheaper(handoff, sizes):
    """Layers 4-5 of 6 share (source 3; compute 1, share 0.5). Kept in one stage -- ends only
    at 1, 2, 3 -- the split is (1,1,1,3): rank 0 holds layers 0 and 3-5, 3.0. The even
    (2,2,1,1) crosses (a boundary before layer 4) but balances 2.5 | 2.5, plus 2h per rank (two
    p2p sides each, p = 2): better below h = 0.25, a tie at 0.25 (no hand-off traffic wins)."""
    modes = layer_modes(6, [4, 5])
    costs = [1.0] * 4 + [0.5] * 2
    layout = balance_v_layout(costs, 2, modes=modes, handoff_cost=handoff)
    assert layout.stage_sizes == sizes
    assert layout.bottleneck == pytest.approx(min(3.0, 2.5 + 2 * handoff))


def test_32_layers_are_proven_and_no_worse_than_the_even_v_split():
    costs = LayerCosts(1.0, 0.84, 0.05, 0.65, handoff_p2p=0.1)
    for p in (2, 4, 8):
        for region in range(0, 32, 4):
            layout = balance_v_region(costs, 32, range(32 - region, 32), p)
            assert layout.optimal, (p, region)
            even = even_layout(costs, 32, range(32 - region, 32), p, placement="v")
            assert even.stage_sizes == _even_sizes(32, p)
            assert layout.bottleneck <= even.bottleneck + 1e-12


def test_v_layout_string_by_hand():
    layout = VStageLayout((2, 1, 3, 1, 2, 1), 3)
    assert layout.to_layout_string() == "V:Ett|t|ttt|t|tt|tL"
    assert VStageLayout((5, 1, 1, 4), 2).to_layout_string(compact=True) == "V:Et*5|t|t|t*4L"
    assert [list(layout.layer_range(r, c)) for r in range(3) for c in (0, 1)] == [[0, 1], [9], [2], [7, 8], [3, 4, 5], [6]]
    assert VStageLayout.from_layout_string("V:Ett|t|ttt|t|tt|tL", 3, 10) == layout
    assert VStageLayout.from_layout_string("V:Et*2|t|t*3|t|(t)*2|tL", 3, 10) == layout  # Megatron's unrolling


@pytest.mark.parametrize("text, match", [
    ("Ett|t|ttt|t|tt|tL", "takes a V layout"),
    ("V:Ett|t|ttt|t|ttttL", "has 5 stages; V placement over --pp 3 has 2 x 3 = 6"),
    ("V:Ett|t||tttt|tt|tL", "V stage 2 holds no decoder layer"),
    ("V:Ett|t|ttt|t|tt|ttL", "holds 11 decoder layers, but --num-layers is 10"),
    ("V:tt|Et|ttt|t|tt|tL", "expected 'E' opening the first stage"),
    ("V:Ett|t|ttt|tL|tt|t", "expected 'E' opening the first stage, 'L' closing the last"),
    ("V:Ett|t|tmt|t|tt|tL", "expected 'E'"),
])
def test_bad_v_layout_strings_name_the_flag(text, match):
    with pytest.raises(ConfigError, match="--pipeline-layout") as error:
        VStageLayout.from_layout_string(text, 3, 10)
    assert match in str(error.value)


def test_impossible_v_requests_name_the_flag():
    with pytest.raises(ConfigError, match="--pp >= 2"):
        balance_v_layout([1.0] * 4, 1)
    with pytest.raises(ConfigError, match="2 x 3 = 6 stages .* the model has 5"):
        balance_v_layout([1.0] * 5, 3)
    with pytest.raises(ValueError, match="two chunks per rank"):
        best_split([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3, [0.0] * 6, [True] * 7, placement="v")


def test_start_up_table_lists_the_v_layout_of_every_region():
    costs = LayerCosts(1.0, 0.5, 0.0, 2.0)
    text = format_layouts(costs, 8, 2, 2, [(0, ()), (3, range(4, 8))], placement="v")
    assert "pipeline plan: 8 layers, --pp 2, V placement (4 stages)" in text
    region0, region4 = balance_v_region(costs, 8, (), 2), balance_v_region(costs, 8, range(4, 8), 2)
    assert region0.stage_sizes == (1, 3, 2, 2)  # as test_the_lm_head_on_rank_0_moves_layers_to_rank_1
    assert f"  --pipeline-layout {region0.to_layout_string(compact=True)}" in text
    assert f"  --pipeline-layout {region4.to_layout_string(compact=True)}" in text
    assert "     0  0,6-7" in text and "     1  1-3,4-5" in text  # rank: chunk 0's layers, chunk 1's
