"""--epas-blocks: several sharing blocks, against an independent reference of K Algorithm-1 loops."""

from __future__ import annotations

import itertools
import json

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.schedule import SharingSchedule
from epas_megatron.sharing.shape import LayerMode, layer_modes, region_layers

C, SRC, SH = LayerMode.COMPUTE, LayerMode.SOURCE, LayerMode.SHARE


# ---------------------------------------------------------------------------- reference
def spans_by_walking(depth, blocks):
    """Cut layers ``0..depth-1`` into ``blocks`` spans by walking the layers: layer ``l`` stays in
    span ``k`` while ``l + 1`` layers are at most ``(k + 1) / blocks`` of the depth (counted in
    integers: ``(l + 1) * blocks <= (k + 1) * depth``), then the walk moves to the next span."""
    spans = [[] for _ in range(blocks)]
    k = 0
    for layer in range(depth):
        while (layer + 1) * blocks > (k + 1) * depth:
            k += 1
        spans[k].append(layer)
    return spans


def reference_blocks(num_layers, target, blocks, exclude_last=0):
    """Each block's layers (shallow -> deep) and source, or ``None`` where the configuration is
    impossible: ``blocks`` must divide the target and every span must keep a computing layer
    before its block."""
    if target == 0:
        return [], []
    if target % blocks:
        return None
    size = target // blocks
    spans = spans_by_walking(num_layers - exclude_last, blocks)
    if any(len(span) < size + 1 for span in spans):
        return None
    return [span[len(span) - size:] for span in spans], [span[len(span) - size - 1] for span in spans]


def multi_block_algorithm1(num_layers, interval, growth, target, blocks, last_iteration, first_switch=None,
                           exclude_last=0):
    """``blocks`` copies of the paper's Algorithm 1 driven by one round-robin pointer (deepest block
    first): at each due iteration, ``growth`` times, pop the deepest remaining target of the block
    under the pointer and move the pointer one block shallower (wrapping to the deepest).

    Returns ``regions[t]``, ``sources[t]`` (one per block with a sharing layer, ascending),
    ``modes[t]`` for t = 0..last_iteration, and the log of (iteration, layers popped in order).
    """
    block_layers, block_sources = reference_blocks(num_layers, target, blocks, exclude_last)
    remaining = [list(layers) for layers in block_layers]  # shallow -> deep
    pointer = len(remaining) - 1
    sharing = set()
    regions, sources, modes, log = {}, {}, {}, []
    for t in range(last_iteration + 1):
        if t == 0:
            due = False
        elif first_switch is None:
            due = t % interval == 0
        else:
            due = t >= first_switch and (t - first_switch) % interval == 0
        if due and any(remaining):
            popped = []
            for _ in range(growth):
                while not remaining[pointer]:
                    pointer = (pointer - 1) % len(remaining)
                layer = remaining[pointer].pop()
                sharing.add(layer)
                popped.append(layer)
                pointer = (pointer - 1) % len(remaining)
            log.append((t, tuple(popped)))
        regions[t] = tuple(sorted(sharing))
        mode = [C] * num_layers
        active = []
        for layers, source in zip(block_layers, block_sources):
            shared = [layer for layer in layers if layer in sharing]
            if shared:
                active.append(shared[0] - 1)
                mode[shared[0] - 1] = SRC
                for layer in shared:
                    mode[layer] = SH
        sources[t], modes[t] = tuple(active), mode
    return regions, sources, modes, log


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def block_configs(num_layers, exclude_last):
    """Every (target, blocks, growth) with growth dividing the target, and whether the reference
    accepts it."""
    for target in range(num_layers - exclude_last):
        for blocks in range(1, num_layers + 2):
            for growth in divisors(target) if target else [1]:
                yield target, blocks, growth, reference_blocks(num_layers, target, blocks, exclude_last) is not None


# ---------------------------------------------------------------------------- exhaustive
@pytest.mark.parametrize("num_layers", range(2, 13))
def test_matches_the_multi_block_reference_exhaustively(num_layers):
    checked = multi = refused = 0
    for exclude_last in range(min(3, num_layers)):
        for target, blocks, growth, valid in block_configs(num_layers, exclude_last):
            for interval, first_switch in ((1, None), (3, 2)):
                if not valid:
                    with pytest.raises(ConfigError, match="--epas-blocks"):
                        SharingSchedule(num_layers, interval, growth, target, first_switch, exclude_last, blocks)
                    refused += 1
                    continue
                schedule = SharingSchedule(num_layers, interval, growth, target, first_switch, exclude_last, blocks)
                start = interval if first_switch is None else first_switch
                final = start + (target // growth - 1) * interval if target else 0
                last = final + interval
                regions, sources, modes, log = multi_block_algorithm1(
                    num_layers, interval, growth, target, blocks, last, first_switch, exclude_last)
                block_layers, block_sources = reference_blocks(num_layers, target, blocks, exclude_last)
                assert schedule.block_ranges == tuple((b[0], b[-1]) for b in block_layers)
                assert schedule.final_iteration == final
                assert schedule.switch_iterations() == log
                switch_its = {t for t, _ in log}
                for t in range(last + 1):
                    assert schedule.sharing_layers(t) == regions[t], (schedule, t)
                    assert schedule.region_size(t) == len(regions[t])
                    assert schedule.source_layers(t) == sources[t]
                    assert schedule.source_layer(t) == (sources[t][-1] if sources[t] else None)
                    assert schedule.layer_modes(t) == modes[t]
                    assert schedule.is_switch(t) == (t in switch_its)
                # every region size maps through the switching order, for the module-level helpers
                order = [layer for _, popped in log for layer in popped]
                for size in range(target + 1):
                    expected = tuple(sorted(order[:size]))
                    assert region_layers(num_layers, size, exclude_last=exclude_last, blocks=blocks,
                                         target_layers=target) == expected
                    step = [t for t in range(last + 1) if len(regions[t]) == size]
                    if step:
                        assert layer_modes(num_layers, expected, exclude_last=exclude_last, blocks=blocks,
                                           target_layers=target) == modes[step[0]]
                if target:
                    full = [layer for layers in block_layers for layer in layers]
                    assert regions[last] == tuple(sorted(full))
                    assert schedule.source_layers(last) == tuple(block_sources)
                checked += 1
                multi += blocks > 1
    assert checked and refused
    if num_layers >= 5:
        assert multi


# ---------------------------------------------------------------------------- by hand
def test_twelve_layers_two_and_three_blocks_by_hand():
    two = SharingSchedule(12, interval=100, growth=1, target_layers=6, blocks=2)
    assert two.block_ranges == ((3, 5), (9, 11))
    assert two.source_layers(10**6) == (2, 8) and two.source_layer(10**6) == 8
    assert [layers for _, layers in two.switch_iterations()] == [(11,), (5,), (10,), (4,), (9,), (3,)]
    assert two.sharing_layers(99) == () and two.source_layers(99) == ()
    assert two.sharing_layers(100) == (11,) and two.source_layers(100) == (10,)
    assert two.sharing_layers(300) == (5, 10, 11) and two.source_layers(300) == (4, 9)
    assert two.sharing_layers(600) == (3, 4, 5, 9, 10, 11)
    assert two.layer_modes(600) == [C, C, SRC, SH, SH, SH, C, C, SRC, SH, SH, SH]
    assert two.layer_modes(200) == [C, C, C, C, SRC, SH, C, C, C, C, SRC, SH]

    three = SharingSchedule(12, interval=100, growth=1, target_layers=6, blocks=3)
    assert three.block_ranges == ((2, 3), (6, 7), (10, 11))
    assert three.source_layers(600) == (1, 5, 9)
    assert [layers for _, layers in three.switch_iterations()] == [(11,), (7,), (3,), (10,), (6,), (2,)]
    assert three.layer_modes(600) == [C, SRC, SH, SH, C, SRC, SH, SH, C, SRC, SH, SH]
    assert three.sharing_layers(200) == (7, 11) and three.source_layers(200) == (6, 10)
    # growth 2 takes two layers of the same order per switch
    grown = SharingSchedule(12, interval=100, growth=2, target_layers=6, blocks=3)
    assert grown.switch_iterations() == [(100, (11, 7)), (200, (3, 10)), (300, (6, 2))]
    assert grown.sharing_layers(200) == (3, 7, 10, 11) and grown.source_layers(200) == (2, 6, 9)


def test_uneven_spans_by_hand():
    # 7 layers: spans 0-2 and 3-6 (the shorter span is the shallow one)
    assert SharingSchedule(7, 1, 1, 2, blocks=2).block_ranges == ((2, 2), (6, 6))
    assert SharingSchedule(7, 1, 1, 2, blocks=2).source_layers(2) == (1, 5)
    # 10 layers, exclude_last 1: layers 0-8 in spans 0-2, 3-5, 6-8; layer 9 never shares
    schedule = SharingSchedule(10, 1, 3, 6, exclude_last=1, blocks=3)
    assert schedule.block_ranges == ((1, 2), (4, 5), (7, 8))
    assert schedule.switch_iterations() == [(1, (8, 5, 2)), (2, (7, 4, 1))]
    assert schedule.layer_modes(2) == [SRC, SH, SH, SRC, SH, SH, SRC, SH, SH, C]
    # one-layer blocks: every other layer, ending at the last
    assert SharingSchedule(8, 1, 1, 4, blocks=4).block_ranges == ((1, 1), (3, 3), (5, 5), (7, 7))


def test_describe_shows_blocks_and_sources():
    lines = SharingSchedule(12, 100, 1, 6, blocks=2).describe(train_iters=1000).splitlines()
    assert lines[0] == ("EPAS schedule: 12 layers, target region 3-5, 9-11 (6 layers in 2 blocks of 3, sources 2, 8), "
                        "growth 1 every 100 iteration(s) from iteration 100")
    assert lines[2] == "  iteration 200: layer(s) 5 switch to sharing -> region 5, 11 (2 layers), source layer(s) 4, 10"
    assert lines[6].endswith("region 3-5, 9-11 (6 layers), source layer(s) 2, 8")
    assert lines[7] == "full region from iteration 600, trained for 401 of 1000 steps (40.1%)"


# ---------------------------------------------------------------------------- one block
def test_one_block_is_the_schedule_without_the_field():
    for num_layers in range(1, 10):
        for exclude_last in range(min(3, num_layers)):
            end = num_layers - 1 - exclude_last
            for target in range(end + 1):
                for growth in divisors(target) if target else [1]:
                    plain = SharingSchedule(num_layers, 2, growth, target, 3, exclude_last)
                    one = SharingSchedule(num_layers, 2, growth, target, 3, exclude_last, blocks=1)
                    assert one == plain and one.blocks == 1
                    state = one.state_dict()
                    assert state.pop("blocks") == 1 and set(state) == set(plain.state_dict()) - {"blocks"}
                    assert SharingSchedule.from_state_dict(state) == plain
                    assert one.describe(100) == plain.describe(100)
                    assert "block" not in one.describe(100)
                    assert one.block_ranges == (((end + 1 - target, end),) if target else ())
                    for t in range(one.final_iteration + 3):
                        region = tuple(range(end + 1 - one.region_size(t), end + 1))
                        assert one.sharing_layers(t) == region
                        assert one.source_layers(t) == ((region[0] - 1,) if region else ())
                        assert one.layer_modes(t) == layer_modes(num_layers, region, exclude_last=exclude_last)
                    # with one block the region of a size does not depend on the target
                    for size in range(target + 1):
                        assert region_layers(num_layers, size, exclude_last=exclude_last, target_layers=target) == \
                            region_layers(num_layers, size, exclude_last=exclude_last) == \
                            tuple(range(end + 1 - size, end + 1))


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(target_layers=6, blocks=4), ["--epas-blocks 4 does not divide --epas-target-layers 6", "[1, 2, 3, 6]"]),
        (dict(target_layers=5, blocks=2), ["--epas-blocks 2 does not divide --epas-target-layers 5"]),
        (dict(target_layers=6, blocks=0), ["--epas-blocks must be an integer >= 1", "got 0"]),
        (dict(target_layers=6, blocks=-2), ["--epas-blocks"]),
        (dict(target_layers=6, blocks=2.0), ["--epas-blocks"]),
        (dict(target_layers=6, blocks=True), ["--epas-blocks"]),
        (dict(target_layers=6, blocks="2"), ["--epas-blocks"]),
        (dict(target_layers=0, blocks=0), ["--epas-blocks"]),
        # 10 of 12 layers in 5 blocks of 2: needs 15 layers; 2 blocks fit, or 5 blocks of 1
        (dict(target_layers=10, blocks=5), ["--epas-blocks 5 with --epas-target-layers 10", "but there are 12",
                                            "among [1, 2] (at most 2)", "at most 5 --epas-target-layers with --epas-blocks 5"]),
        (dict(target_layers=7, blocks=7), ["--epas-blocks 7", "no target fits 7 blocks", "at most 6 blocks"]),
        (dict(target_layers=6, blocks=6, exclude_last=1), ["--epas-blocks 6", "--epas-exclude-last 1", "but there are 11",
                                                           "(at most 3)"]),
    ],
)
def test_invalid_blocks_name_the_flags(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        SharingSchedule(12, 1, 1, **kwargs)
    for needle in needles:
        assert needle in str(info.value)


def test_largest_valid_values_in_the_message_are_valid():
    for num_layers in range(2, 13):
        for target in range(1, num_layers):
            for blocks in range(2, num_layers + 1):
                if reference_blocks(num_layers, target, blocks) is not None or target % blocks:
                    continue
                with pytest.raises(ConfigError) as info:
                    SharingSchedule(num_layers, 1, 1, target, blocks=blocks)
                message = str(info.value)
                largest = max(k for k in divisors(target) if reference_blocks(num_layers, target, k) is not None)
                assert f"(at most {largest})" in message
                SharingSchedule(num_layers, 1, 1, target, blocks=largest)
                fitting = [t for t in range(blocks, num_layers, blocks) if reference_blocks(num_layers, t, blocks) is not None]
                if fitting:
                    assert f"at most {fitting[-1]} --epas-target-layers with --epas-blocks {blocks}" in message
                else:
                    assert f"no target fits {blocks} blocks" in message


def test_epas_off_takes_any_number_of_blocks():
    off = SharingSchedule(4, 1, 1, 0, blocks=9)
    assert off.block_ranges == () and off.sharing_layers(100) == () and off.layer_modes(100) == [C] * 4
    assert region_layers(4, 0, blocks=9) == ()


def test_region_layers_with_blocks():
    assert region_layers(12, 6, blocks=2) == (3, 4, 5, 9, 10, 11)
    assert region_layers(12, 3, blocks=2, target_layers=6) == (5, 10, 11)
    assert region_layers(12, 0, blocks=2, target_layers=6) == ()
    # without a target: the same layers (they never depend on it), checked against the smallest
    # target of equal blocks that holds them
    assert region_layers(12, 3, flag="--regions", blocks=2) == (5, 10, 11)
    with pytest.raises(ConfigError, match="--epas-blocks 2 with --regions 12"):
        region_layers(12, 11, flag="--regions", blocks=2)  # 6 + 6: no source left in a span
    with pytest.raises(ConfigError, match="--regions: a region of 7 sharing layers is larger than the --epas-target-layers 6"):
        region_layers(12, 7, flag="--regions", blocks=2, target_layers=6)
    with pytest.raises(ConfigError, match="--regions: a region of 4 .* --epas-target-layers 3"):
        region_layers(12, 4, flag="--regions", target_layers=3)  # one block too
    for bad in (12, -1, 2.0):
        with pytest.raises(ConfigError, match="--epas-target-layers"):
            region_layers(12, 1, blocks=1, target_layers=bad)
    with pytest.raises(ConfigError, match="--epas-blocks"):
        region_layers(12, 2, blocks=0)
    with pytest.raises(ConfigError, match="--epas-blocks 5 with --epas-target-layers 10"):
        region_layers(12, 2, blocks=5, target_layers=10)


def test_region_order_by_hand():
    from epas_megatron.sharing.shape import region_order

    # 12 layers, two spans 0-5 and 6-11: blocks at their deep ends, the deeper block first.
    assert region_order(12, 6, blocks=2) == (11, 5, 10, 4, 9, 3)
    assert region_order(8, 4, blocks=2) == (7, 3, 6, 2) and region_order(8, 4) == (7, 6, 5, 4)
    assert region_order(8, 3, exclude_last=1) == (6, 5, 4)
    for r in range(7):  # every prefix is the region of that size
        assert tuple(sorted(region_order(12, 6, blocks=2)[:r])) == region_layers(12, r, blocks=2)


def test_layer_modes_with_blocks_rejects_other_sets():
    assert layer_modes(12, [3, 4, 5, 9, 10, 11], blocks=2) == [C, C, SRC, SH, SH, SH, C, C, SRC, SH, SH, SH]
    with pytest.raises(ConfigError) as info:
        layer_modes(12, [4, 5, 11], flag="--regions", blocks=2, target_layers=6)
    message = str(info.value)
    assert message.startswith("--regions: the sharing layers 4-5, 11 are not a region of --epas-blocks 2")
    assert "blocks 3-5, 9-11 of the 6-layer target region" in message and "would be 5, 10-11" in message
    # the one-block region is not a two-block region
    with pytest.raises(ConfigError, match="not a region of --epas-blocks 2"):
        layer_modes(12, range(6, 12), blocks=2)
    with pytest.raises(ConfigError, match="--epas-blocks 2 does not divide --epas-target-layers 3"):
        layer_modes(12, [10, 11], blocks=2, target_layers=3)
    with pytest.raises(ConfigError, match="leave no source"):
        layer_modes(4, range(4), blocks=2)
    with pytest.raises(ConfigError, match="--epas-blocks"):
        layer_modes(12, [], blocks=0)
    # exhaustively on small models: exactly the sets region_layers gives are accepted
    for num_layers in range(2, 8):
        for blocks in (2, 3):
            for target in range(blocks, num_layers, blocks):
                if reference_blocks(num_layers, target, blocks) is None:
                    continue
                valid = {region_layers(num_layers, size, blocks=blocks, target_layers=target) for size in range(target + 1)}
                for size in range(target + 1):
                    for subset in itertools.combinations(range(num_layers), size):
                        if subset in valid:
                            layer_modes(num_layers, subset, blocks=blocks, target_layers=target)
                        else:
                            with pytest.raises(ConfigError, match="--epas-blocks"):
                                layer_modes(num_layers, subset, blocks=blocks, target_layers=target)


# ---------------------------------------------------------------------------- checkpoints
def test_blocks_state_round_trip_old_states_and_resume_check():
    schedule = SharingSchedule(12, 100, 1, 6, blocks=2)
    state = schedule.state_dict()
    assert state["blocks"] == 2 and all(type(value) is int for value in state.values())
    restored = SharingSchedule.from_state_dict(json.loads(json.dumps(state)))
    assert restored == schedule and restored.block_ranges == ((3, 5), (9, 11))
    schedule.check_resume(state, iteration=300)
    # checkpoints written before the option existed: one block
    old = {key: value for key, value in SharingSchedule(12, 100, 1, 6).state_dict().items() if key != "blocks"}
    assert SharingSchedule.from_state_dict(old) == SharingSchedule(12, 100, 1, 6)
    assert SharingSchedule.from_state_dict(old).blocks == 1
    SharingSchedule(12, 100, 1, 6).check_resume(old, iteration=300)
    with pytest.raises(ConfigError) as info:
        schedule.check_resume(old, iteration=300)
    message = str(info.value)
    assert "--epas-blocks: 1 in the checkpoint, 2 in this run" in message
    assert "checkpoint's region is 9-11 but this run's would be 5, 10-11" in message
    assert schedule.differences_from(SharingSchedule(12, 100, 1, 6, blocks=3)) == [
        "--epas-blocks: 3 in the checkpoint, 2 in this run"
    ]
    with pytest.raises(ConfigError, match="--epas-blocks 4 does not divide"):
        SharingSchedule.from_state_dict({**state, "blocks": 4})


def test_from_flags_with_blocks():
    assert SharingSchedule.from_flags(12, 100, 1, "0.5", blocks=3) == SharingSchedule(12, 100, 1, 6, blocks=3)
    with pytest.raises(ConfigError, match="--epas-blocks 4"):
        SharingSchedule.from_flags(12, 100, 1, "0.5", blocks=4)
