"""Tests for the progressive sharing schedule against a direct transcription of Algorithm 1."""

from __future__ import annotations

import itertools
import json

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.schedule import SharingSchedule, resolve_target_layers
from epas_megatron.sharing.shape import LayerMode, layer_modes, region_layers


# ---------------------------------------------------------------------------- references
def algorithm1(num_layers, interval, growth, target_layers, last_iteration, first_switch=None, exclude_last=0):
    """Algorithm 1 of the paper as a stateful loop, with the optional first switch and the
    target block ``S_c`` ending ``exclude_last`` layers before the last (the paper's ablation).

    Returns ``regions[t]`` (sorted sharing layers for the step of iteration t, t = 0 included)
    and ``log`` (iteration, layers popped in order) for every switch.
    """
    end = num_layers - exclude_last  # one past S_c's deepest layer
    remaining = list(range(end - target_layers, end))  # S_c, shallow -> deep
    sharing = set()
    regions = {0: ()}
    log = []
    for t in range(1, last_iteration + 1):
        if first_switch is None:
            due = t % interval == 0  # the paper's condition, verbatim
        else:
            due = t >= first_switch and (t - first_switch) % interval == 0
        if due and remaining:
            popped = []
            for _ in range(growth):  # the deepest B remaining targets switch
                layer = remaining.pop()
                sharing.add(layer)
                popped.append(layer)
            log.append((t, tuple(popped)))
        regions[t] = tuple(sorted(sharing))  # the switch at t applies to the step of t
    return regions, log


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_configs(num_layers, max_interval=4, max_first_switch=5):
    for target in range(num_layers):
        for growth in divisors(target) if target else [1, 2, 3]:
            for interval in range(1, max_interval + 1):
                for first_switch in [None, *range(1, max_first_switch + 1)]:
                    yield target, growth, interval, first_switch


# ---------------------------------------------------------------------------- exhaustive
@pytest.mark.parametrize("num_layers", range(2, 11))
def test_matches_algorithm1_exhaustively(num_layers):
    checked = 0
    for target, growth, interval, first_switch in valid_configs(num_layers):
        schedule = SharingSchedule(num_layers, interval, growth, target, first_switch)
        start = interval if first_switch is None else first_switch
        expected_final = start + (target // growth - 1) * interval if target else 0
        last = expected_final + 2 * interval + 3
        regions, log = algorithm1(num_layers, interval, growth, target, last, first_switch)

        assert schedule.first_switch == start
        assert schedule.final_iteration == expected_final
        assert schedule.switch_iterations() == log
        assert schedule.num_switches == len(log)
        switch_its = {t for t, _ in log}
        previous = ()
        for t in range(last + 1):
            region = schedule.sharing_layers(t)
            assert region == regions[t], (schedule, t)
            assert schedule.region_size(t) == len(region)
            # monotone, contiguous, ends at the last layer, never the whole model
            assert set(previous) <= set(region)
            if region:
                assert region == tuple(range(region[0], num_layers))
                assert region[0] >= 1
                assert schedule.source_layer(t) == region[0] - 1
            else:
                assert schedule.source_layer(t) is None
            assert schedule.is_switch(t) == (t in switch_its)
            assert schedule.is_switch(t) == (region != previous)
            later = [s for s in sorted(switch_its) if s > t]
            assert schedule.next_switch(t) == (later[0] if later else None)
            modes = schedule.layer_modes(t)
            assert modes.count(LayerMode.SHARE) == len(region)
            assert modes.count(LayerMode.SOURCE) == (1 if region else 0)
            previous = region
        # the full region first applies at final_iteration and stays
        assert len(regions[last]) == target
        if target:
            assert len(regions[expected_final]) == target
            assert len(regions[expected_final - 1]) < target
        assert schedule.sharing_layers(10**12) == tuple(range(num_layers - target, num_layers))
        checked += 1
    assert checked >= num_layers * 4 * 6  # every target, interval and first switch


@pytest.mark.parametrize("num_layers", range(2, 11))
def test_default_first_switch_is_algorithm1_verbatim(num_layers):
    # With first_switch unset the schedule must equal the paper's `t % I == 0` loop, and the
    # final region is reached at t = I * |S_c| / B.
    for target in range(1, num_layers):
        for growth in divisors(target):
            for interval in (1, 2, 3, 7):
                schedule = SharingSchedule(num_layers, interval, growth, target)
                assert schedule.final_iteration == interval * target // growth
                last = schedule.final_iteration + interval
                regions, _ = algorithm1(num_layers, interval, growth, target, last)
                assert all(schedule.sharing_layers(t) == regions[t] for t in range(last + 1))


def test_paper_cases():
    # TinyLLaMA continual pretraining: region grown to 5 of 22 layers, B = 1.
    schedule = SharingSchedule(num_layers=22, interval=1000, growth=1, target_layers=5)
    assert schedule.final_iteration == 5000
    assert schedule.sharing_layers(999) == ()
    assert schedule.sharing_layers(1000) == (21,)
    assert schedule.source_layer(1000) == 20
    assert schedule.sharing_layers(4999) == (18, 19, 20, 21)
    assert schedule.sharing_layers(5000) == (17, 18, 19, 20, 21)
    assert schedule.source_layer(5000) == 16
    # From-scratch runs: half the layers, here with B = 2 and an early first switch.
    schedule = SharingSchedule(12, interval=100, growth=2, target_layers=6, first_switch=10)
    assert schedule.switch_iterations() == [(10, (11, 10)), (110, (9, 8)), (210, (7, 6))]
    assert schedule.final_iteration == 210


def test_epas_off():
    schedule = SharingSchedule(8, interval=5, growth=1, target_layers=0)
    assert not schedule.enabled
    assert schedule.final_iteration == 0
    assert schedule.switch_iterations() == []
    assert all(schedule.sharing_layers(t) == () for t in range(50))
    assert not any(schedule.is_switch(t) for t in range(50))
    assert schedule.next_switch(0) is None
    assert schedule.layer_modes(7) == ["compute"] * 8
    assert schedule.check_against_training(1) == []
    assert "off" in schedule.describe()


def test_negative_iteration_is_a_programming_error():
    schedule = SharingSchedule(4, 1, 1, 2)
    for method in (schedule.sharing_layers, schedule.region_size, schedule.is_switch):
        with pytest.raises(ValueError):
            method(-1)


# ---------------------------------------------------------------------------- validation
INVALID = [
    (dict(num_layers=4, interval=0, growth=1, target_layers=2), "--epas-interval"),
    (dict(num_layers=4, interval=-3, growth=1, target_layers=2), "--epas-interval"),
    (dict(num_layers=4, interval=1.5, growth=1, target_layers=2), "--epas-interval"),
    (dict(num_layers=4, interval=True, growth=1, target_layers=2), "--epas-interval"),
    (dict(num_layers=4, interval="2", growth=1, target_layers=2), "--epas-interval"),
    (dict(num_layers=4, interval=1, growth=0, target_layers=2), "--epas-growth"),
    (dict(num_layers=4, interval=1, growth=-1, target_layers=2), "--epas-growth"),
    (dict(num_layers=4, interval=1, growth=2.0, target_layers=2), "--epas-growth"),
    (dict(num_layers=8, interval=1, growth=3, target_layers=4), "--epas-growth"),
    (dict(num_layers=8, interval=1, growth=5, target_layers=4), "--epas-growth"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=-1), "--epas-target-layers"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=4), "--epas-target-layers"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=9), "--epas-target-layers"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=0.5), "--epas-target-layers"),
    (dict(num_layers=1, interval=1, growth=1, target_layers=1), "--epas-target-layers"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=2, first_switch=0),
     "--epas-first-switch"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=2, first_switch=-5),
     "--epas-first-switch"),
    (dict(num_layers=4, interval=1, growth=1, target_layers=2, first_switch=2.0),
     "--epas-first-switch"),
    (dict(num_layers=0, interval=1, growth=1, target_layers=0), "--num-layers"),
]


@pytest.mark.parametrize("kwargs, flag", INVALID)
def test_invalid_configuration_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        SharingSchedule(**kwargs)


def test_every_non_dividing_growth_is_rejected():
    for num_layers in range(2, 11):
        for target in range(1, num_layers):
            for growth in range(1, num_layers + 2):
                if target % growth == 0:
                    SharingSchedule(num_layers, 1, growth, target)
                else:
                    with pytest.raises(ConfigError, match="--epas-growth") as info:
                        SharingSchedule(num_layers, 1, growth, target)
                    assert str(divisors(target)) in str(info.value)


def test_frozen_and_first_switch_resolved():
    schedule = SharingSchedule(6, 4, 1, 3)
    assert schedule == SharingSchedule(6, 4, 1, 3, first_switch=4)
    assert schedule != SharingSchedule(6, 4, 1, 3, first_switch=5)
    with pytest.raises(AttributeError):
        schedule.interval = 2


# ---------------------------------------------------------------------------- target layers
@pytest.mark.parametrize(
    "target, num_layers, expected",
    [
        (0, 12, 0),
        ("0", 12, 0),
        (0.0, 12, 0),
        (6, 12, 6),
        ("6", 12, 6),
        (" 6 ", 12, 6),
        ("6.0", 12, 6),
        (6.0, 12, 6),
        (11, 12, 11),
        (0.5, 12, 6),
        ("0.5", 12, 6),
        (0.5, 22, 11),
        (0.25, 22, 5),  # floor(5.5)
        (0.5, 7, 3),  # floor(3.5)
        (0.1, 5, 1),  # floor(0.5) = 0, but at least 1
        ("0.01", 2, 1),
        (0.29, 100, 29),  # 0.29 * 100 is 28.999... in binary floating point
        ("0.29", 100, 29),
        (0.7, 10, 7),
        (1, 2, 1),
    ],
)
def test_resolve_target_layers(target, num_layers, expected):
    assert resolve_target_layers(target, num_layers) == expected


@pytest.mark.parametrize(
    "target, num_layers",
    [(-1, 12), ("-0.5", 12), (12, 12), ("12", 12), (1.5, 12), ("1.5", 12), ("abc", 12),
     ("", 12), (True, 12), (None, 12), (float("nan"), 12), (float("inf"), 12), ("1/0", 12),
     (0.5, 1), (1, 1)],
)
def test_resolve_target_layers_rejects(target, num_layers):
    with pytest.raises(ConfigError, match="--epas-target-layers"):
        resolve_target_layers(target, num_layers)


def test_resolve_target_fractions_exhaustive():
    # Independent integer arithmetic: fraction p/100 of L layers -> max(1, floor(p*L/100)).
    for num_layers in range(1, 41):
        for percent in range(1, 100):
            expected = max(1, percent * num_layers // 100)
            for form in (percent / 100, f"{percent / 100}"):
                if expected > num_layers - 1:
                    with pytest.raises(ConfigError, match="--epas-target-layers"):
                        resolve_target_layers(form, num_layers)
                else:
                    assert resolve_target_layers(form, num_layers) == expected


def test_from_flags():
    schedule = SharingSchedule.from_flags(22, interval=50, growth=1, target="0.5")
    assert schedule == SharingSchedule(22, 50, 1, 11)
    with pytest.raises(ConfigError, match="--epas-growth"):
        SharingSchedule.from_flags(22, interval=50, growth=2, target="0.5")


# ---------------------------------------------------------------------------- training length
def test_check_against_training_errors_when_final_region_is_late():
    schedule = SharingSchedule(12, interval=100, growth=2, target_layers=6)  # final at 300
    with pytest.raises(ConfigError) as info:
        schedule.check_against_training(299)
    message = str(info.value)
    for needle in ("300", "--train-iters is 299", "--epas-interval", "--epas-growth"):
        assert needle in message


def test_check_against_training_warns_in_last_ten_percent():
    schedule = SharingSchedule(12, interval=30, growth=2, target_layers=6)  # final at 90
    assert schedule.check_against_training(100) == []  # 0.9 * 100 = 90: not late
    assert schedule.check_against_training(10_000) == []
    warnings = schedule.check_against_training(99)  # 90 > 89.1
    assert len(warnings) == 1 and "10 step(s)" in warnings[0]
    assert len(schedule.check_against_training(90)) == 1  # reached at the very last step
    late = SharingSchedule(12, interval=30, growth=2, target_layers=6, first_switch=31)
    assert len(late.check_against_training(100)) == 1  # final at 91
    # the boundary, exhaustively: warn iff final > 0.9 * train_iters
    for train_iters in range(90, 200):
        warned = bool(schedule.check_against_training(train_iters))
        assert warned == (90 * 10 > 9 * train_iters)


@pytest.mark.parametrize("train_iters", [0, -1, 2.5, None])
def test_check_against_training_rejects_bad_train_iters(train_iters):
    with pytest.raises(ConfigError, match="--train-iters"):
        SharingSchedule(4, 1, 1, 2).check_against_training(train_iters)


def test_describe_lists_every_switch():
    schedule = SharingSchedule(12, interval=100, growth=2, target_layers=6)
    text = schedule.describe(train_iters=1000)
    lines = text.splitlines()
    assert len(lines) == 1 + 3 + 1
    assert "iteration 100: layer(s) 11, 10 switch to sharing -> region 10-11" in lines[1]
    assert "source layer 9" in lines[1]
    assert "iteration 300: layer(s) 7, 6" in lines[3] and "region 6-11 (6 layers)" in lines[3]
    assert "701 of 1000" in lines[4]


# ---------------------------------------------------------------------------- checkpoints
def test_state_round_trip():
    for num_layers in range(2, 8):
        for target, growth, interval, first_switch in valid_configs(num_layers, 3, 3):
            schedule = SharingSchedule(num_layers, interval, growth, target, first_switch)
            state = schedule.state_dict()
            assert all(type(value) is int for value in state.values())
            restored = SharingSchedule.from_state_dict(json.loads(json.dumps(state)))
            assert restored == schedule
            assert restored.differences_from(schedule) == []
            schedule.check_resume(state, iteration=5)


def test_check_resume_says_what_differs():
    saved = SharingSchedule(12, interval=100, growth=2, target_layers=6)
    run = SharingSchedule(12, interval=50, growth=2, target_layers=6)
    assert run.differences_from(saved) == [
        "--epas-interval: 100 in the checkpoint, 50 in this run",
        "--epas-first-switch: 100 in the checkpoint, 50 in this run",
    ]
    with pytest.raises(ConfigError) as info:
        run.check_resume(saved.state_dict(), iteration=150)
    message = str(info.value)
    assert "--epas-interval" in message
    assert "checkpoint's region is 10-11 but this run's would be 6-11" in message
    with pytest.raises(ConfigError, match="--num-layers"):
        SharingSchedule(10, 100, 2, 6).check_resume(saved.state_dict(), iteration=0)


@pytest.mark.parametrize(
    "state",
    [
        {"num_layers": 4, "interval": 1, "growth": 1, "target_layers": 2},
        {"num_layers": 4, "interval": 1, "growth": 1, "target_layers": 2, "first_switch": 1,
         "extra": 0},
    ],
)
def test_malformed_state_is_rejected(state):
    with pytest.raises(ConfigError, match="malformed"):
        SharingSchedule.from_state_dict(state)


def test_invalid_saved_state_is_validated():
    with pytest.raises(ConfigError, match="--epas-growth"):
        SharingSchedule.from_state_dict(
            {"num_layers": 8, "interval": 1, "growth": 3, "target_layers": 4, "first_switch": 1}
        )


# ---------------------------------------------------------------------------- layer modes
C, SRC, SH = "compute", "source", "share"


@pytest.mark.parametrize(
    "num_layers, sharing, expected",
    [
        (1, [], [C]),
        (4, [], [C, C, C, C]),
        (4, [3], [C, C, SRC, SH]),
        (4, [2, 3], [C, SRC, SH, SH]),
        (4, [3, 2, 1], [SRC, SH, SH, SH]),
        (4, (1, 2, 3), [SRC, SH, SH, SH]),
        (6, range(3, 6), [C, C, SRC, SH, SH, SH]),
    ],
)
def test_layer_modes(num_layers, sharing, expected):
    modes = layer_modes(num_layers, sharing)
    assert modes == expected
    assert all(isinstance(mode, str) for mode in modes)


@pytest.mark.parametrize(
    "num_layers, sharing, reason",
    [
        (4, [2], "last layer"),
        (4, [1, 3], "contiguous"),
        (4, [1, 2], "last layer"),
        (4, [0, 1, 2, 3], "no source"),
        (1, [0], "no source"),
        (4, [4], "not a layer index"),
        (4, [-1], "not a layer index"),
        (4, [3, 3], "duplicates"),
        (4, ["3"], "not a layer index"),
    ],
)
def test_layer_modes_rejects(num_layers, sharing, reason):
    with pytest.raises(ConfigError, match="--epas-target-layers") as info:
        layer_modes(num_layers, sharing)
    assert reason in str(info.value)


def test_layer_modes_exhaustive_subsets():
    for num_layers in range(1, 8):
        for size in range(num_layers + 1):
            for subset in itertools.combinations(range(num_layers), size):
                valid = subset == tuple(range(num_layers - size, num_layers)) and size < num_layers
                if not valid:
                    with pytest.raises(ConfigError):
                        layer_modes(num_layers, subset)
                    continue
                modes = layer_modes(num_layers, subset)
                for layer, mode in enumerate(modes):
                    if layer in subset:
                        assert mode == SH
                    elif subset and layer == subset[0] - 1:
                        assert mode == SRC
                    else:
                        assert mode == C


def test_layer_modes_custom_flag_and_region_layers():
    with pytest.raises(ConfigError, match="--eval-sharing-layers"):
        layer_modes(4, [1], flag="--eval-sharing-layers")
    assert region_layers(22, 5) == (17, 18, 19, 20, 21)
    assert region_layers(22, 0) == ()
    for bad in (22, -1, 2.0):
        with pytest.raises(ConfigError, match="--eval-region"):
            region_layers(22, bad, flag="--eval-region")


# ---------------------------------------------------------------------------- --epas-exclude-last
def test_exclude_last_matches_algorithm1_exhaustively():
    """Every valid (layers, exclude_last, target, growth, interval, first switch) against the
    reference loop: switches, regions, sources, and the tail layers that always compute."""
    checked = 0
    for num_layers in range(2, 9):
        for exclude_last in range(1, num_layers):
            for target in range(num_layers - exclude_last):
                for growth in divisors(target) if target else [1]:
                    for interval, first_switch in ((1, None), (3, None), (2, 5)):
                        schedule = SharingSchedule(num_layers, interval, growth, target, first_switch, exclude_last)
                        final = schedule.final_iteration
                        last = final + 2 * interval + 1
                        regions, log = algorithm1(num_layers, interval, growth, target, last, first_switch, exclude_last)
                        assert schedule.switch_iterations() == log
                        end = num_layers - 1 - exclude_last
                        assert schedule.region_end == end
                        for t in range(last + 1):
                            region = schedule.sharing_layers(t)
                            assert region == regions[t], (schedule, t)
                            assert schedule.source_layer(t) == (region[0] - 1 if region else None)
                            modes = schedule.layer_modes(t)
                            assert modes[end + 1:] == [LayerMode.COMPUTE] * exclude_last
                            assert modes.count(LayerMode.SHARE) == len(region)
                            if region:
                                assert region[-1] == end and modes[region[0] - 1] == LayerMode.SOURCE
                        checked += 1
    assert checked > 300


def test_exclude_last_paper_ablation_case():
    # 22 layers, a region of 5 that stops one layer short of the last.
    schedule = SharingSchedule(22, interval=1000, growth=1, target_layers=5, exclude_last=1)
    assert schedule.switch_iterations() == [(1000, (20,)), (2000, (19,)), (3000, (18,)), (4000, (17,)), (5000, (16,))]
    assert schedule.sharing_layers(999) == ()
    assert schedule.sharing_layers(1000) == (20,) and schedule.source_layer(1000) == 19
    assert schedule.sharing_layers(5000) == (16, 17, 18, 19, 20) and schedule.source_layer(5000) == 15
    assert schedule.layer_modes(5000)[15:] == [SRC, SH, SH, SH, SH, SH, C]
    # growth 2 from the region's end
    schedule = SharingSchedule(12, interval=100, growth=2, target_layers=6, first_switch=10, exclude_last=2)
    assert schedule.switch_iterations() == [(10, (9, 8)), (110, (7, 6)), (210, (5, 4))]
    # 0 is the default and changes nothing
    assert SharingSchedule(12, 100, 2, 6, 10, 0) == SharingSchedule(12, 100, 2, 6, 10)


def test_exclude_last_describe():
    schedule = SharingSchedule(8, interval=10, growth=1, target_layers=3, exclude_last=2)
    lines = schedule.describe(train_iters=100).splitlines()
    assert lines[0] == ("EPAS schedule: 8 layers, target region 3-5 (3 layers), layer(s) 6-7 never share "
                        "(--epas-exclude-last 2), growth 1 every 10 iteration(s) from iteration 10")
    assert "iteration 10: layer(s) 5 switch to sharing -> region 5 (1 layers), source layer 4" in lines[1]
    assert "iteration 30: layer(s) 3 switch to sharing -> region 3-5 (3 layers), source layer 2" in lines[3]
    assert "never share" not in SharingSchedule(8, 10, 1, 3).describe()


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        (dict(num_layers=4, interval=1, growth=1, target_layers=3, exclude_last=1),
         ["--epas-target-layers 3", "--epas-exclude-last 1", "at most 2"]),
        (dict(num_layers=8, interval=1, growth=1, target_layers=2, exclude_last=6),
         ["--epas-target-layers 2", "--epas-exclude-last 6", "at most 1"]),
        (dict(num_layers=4, interval=1, growth=1, target_layers=0, exclude_last=4), ["--epas-exclude-last", "between 0 and 3"]),
        (dict(num_layers=4, interval=1, growth=1, target_layers=1, exclude_last=-1), ["--epas-exclude-last"]),
        (dict(num_layers=4, interval=1, growth=1, target_layers=1, exclude_last=1.0), ["--epas-exclude-last"]),
        (dict(num_layers=4, interval=1, growth=1, target_layers=1, exclude_last=True), ["--epas-exclude-last"]),
        (dict(num_layers=4, interval=1, growth=1, target_layers=1, exclude_last="1"), ["--epas-exclude-last"]),
    ],
)
def test_exclude_last_validation_names_the_flags(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        SharingSchedule(**kwargs)
    for needle in needles:
        assert needle in str(info.value)


def test_exclude_last_from_flags_and_largest_target():
    # A fraction is of all layers; the count must still fit before the excluded tail.
    assert SharingSchedule.from_flags(8, 10, 1, "0.5", exclude_last=3) == SharingSchedule(8, 10, 1, 4, exclude_last=3)
    with pytest.raises(ConfigError, match="--epas-exclude-last 4"):
        SharingSchedule.from_flags(8, 10, 1, "0.5", exclude_last=4)
    for num_layers in range(2, 9):
        for exclude_last in range(num_layers):
            SharingSchedule(num_layers, 1, 1, num_layers - 1 - exclude_last, exclude_last=exclude_last)
            with pytest.raises(ConfigError, match="--epas-target-layers"):
                SharingSchedule(num_layers, 1, 1, num_layers - exclude_last, exclude_last=exclude_last)


def test_region_layers_with_exclude_last():
    assert region_layers(22, 5, exclude_last=2) == (15, 16, 17, 18, 19)
    assert region_layers(4, 2, exclude_last=1) == (1, 2)
    assert region_layers(4, 0, exclude_last=3) == ()
    assert region_layers(4, 2, "--regions", 0) == (2, 3)
    with pytest.raises(ConfigError) as info:
        region_layers(4, 3, flag="--regions", exclude_last=1)
    assert "--regions 3" in str(info.value) and "--epas-exclude-last 1" in str(info.value)
    assert "between 0 and 2 layers" in str(info.value)
    for bad in (-1, 4, 2.0, None):
        with pytest.raises(ConfigError, match="--epas-exclude-last"):
            region_layers(4, 0, exclude_last=bad)


@pytest.mark.parametrize(
    "num_layers, sharing, exclude_last, expected",
    [
        (4, [], 1, [C, C, C, C]),
        (4, [2], 1, [C, SRC, SH, C]),
        (4, [1, 2], 1, [SRC, SH, SH, C]),
        (4, [1], 2, [SRC, SH, C, C]),
        (6, range(2, 4), 2, [C, SRC, SH, SH, C, C]),
    ],
)
def test_layer_modes_with_exclude_last(num_layers, sharing, exclude_last, expected):
    assert layer_modes(num_layers, sharing, exclude_last=exclude_last) == expected


def test_layer_modes_with_exclude_last_rejects_and_names_the_flags():
    with pytest.raises(ConfigError) as info:
        layer_modes(4, [2, 3], flag="--regions", exclude_last=1)  # includes an excluded layer
    message = str(info.value)
    assert message.startswith("--regions:") and "must end at layer 2" in message and "--epas-exclude-last 1" in message
    with pytest.raises(ConfigError, match="--epas-exclude-last"):
        layer_modes(4, [1, 2])  # ends before the last layer, but exclude_last is 0
    with pytest.raises(ConfigError, match="no source"):
        layer_modes(4, [0, 1, 2], exclude_last=1)
    with pytest.raises(ConfigError, match="contiguous"):
        layer_modes(5, [1, 3], exclude_last=1)
    # exhaustively: valid iff a non-empty-prefix-leaving block ending at num_layers - 1 - N
    for num_layers in range(1, 7):
        for exclude_last in range(num_layers):
            end = num_layers - 1 - exclude_last
            for size in range(num_layers + 1):
                for subset in itertools.combinations(range(num_layers), size):
                    valid = subset == tuple(range(end + 1 - size, end + 1)) and size <= end
                    if not valid:
                        with pytest.raises(ConfigError):
                            layer_modes(num_layers, subset, exclude_last=exclude_last)
                        continue
                    modes = layer_modes(num_layers, subset, exclude_last=exclude_last)
                    assert [m == SH for m in modes] == [i in subset for i in range(num_layers)]
                    assert modes[end + 1:] == [C] * exclude_last


def test_exclude_last_state_round_trip_old_states_and_resume_check():
    schedule = SharingSchedule(8, 10, 1, 3, exclude_last=2)
    state = schedule.state_dict()
    assert state["exclude_last"] == 2
    assert SharingSchedule.from_state_dict(json.loads(json.dumps(state))) == schedule
    # States written before the option existed: the region included the last layer.
    old = {key: value for key, value in SharingSchedule(8, 10, 1, 3).state_dict().items() if key != "exclude_last"}
    assert SharingSchedule.from_state_dict(old) == SharingSchedule(8, 10, 1, 3)
    SharingSchedule(8, 10, 1, 3).check_resume(old, iteration=20)
    with pytest.raises(ConfigError) as info:
        schedule.check_resume(old, iteration=20)
    message = str(info.value)
    assert "--epas-exclude-last: 0 in the checkpoint, 2 in this run" in message
    assert "checkpoint's region is 6-7 but this run's would be 4-5" in message
    assert schedule.differences_from(SharingSchedule(8, 10, 1, 3, exclude_last=1)) == [
        "--epas-exclude-last: 1 in the checkpoint, 2 in this run"
    ]
