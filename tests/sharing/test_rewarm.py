"""The LR re-warm after each switch (epas_megatron.sharing.rewarm) against factors worked out by hand."""

from fractions import Fraction

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.rewarm import SwitchRewarm, rewarm_factor
from epas_megatron.sharing.schedule import SharingSchedule

# 4 layers, 2 targets, one per switch every 4 iterations: switches at 4 and 8.
TINY = SharingSchedule(num_layers=4, interval=4, growth=1, target_layers=2)


def test_the_hand_computed_ramp_of_a_tiny_schedule():
    # N = 2: the steps of a switch t and of t + 1 run at 1/3 and 2/3 of the scheduler's LR.
    assert [rewarm_factor(i, TINY, 2) for i in range(1, 13)] == [1, 1, 1, 1 / 3, 2 / 3, 1, 1, 1 / 3, 2 / 3, 1, 1, 1]
    # N = 3 (the largest below the interval): 1/4, 2/4, 3/4 at t, t+1, t+2; the next switch starts afresh.
    assert [rewarm_factor(i, TINY, 3) for i in range(3, 13)] == [1, 0.25, 0.5, 0.75, 1, 0.25, 0.5, 0.75, 1, 1]
    # N = 0 and EPAS off: 1 everywhere.
    off = SharingSchedule(num_layers=4, interval=4, growth=1, target_layers=0)
    assert {rewarm_factor(i, TINY, 0) for i in range(1, 13)} == {rewarm_factor(i, off, 3) for i in range(1, 13)} == {1.0}


def test_the_cpu_recipe_schedule_by_hand():
    # 8 layers, half of them one per switch every 50 iterations: switches at 50, 100, 150, 200.
    schedule = SharingSchedule(num_layers=8, interval=50, growth=1, target_layers=4)
    factor = lambda i: Fraction(rewarm_factor(i, schedule, 12)).limit_denominator(100)
    assert [factor(i) for i in (1, 49, 50, 51, 61, 62, 99, 100, 200, 211, 212, 250, 400)] == [
        1, 1, Fraction(1, 13), Fraction(2, 13), Fraction(12, 13), 1, 1, Fraction(1, 13), Fraction(1, 13), Fraction(12, 13), 1, 1, 1]
    assert SwitchRewarm(schedule, 12).windows() == [(50, 61), (100, 111), (150, 161), (200, 211)]
    # A moved first switch and growth 2: switches at 10 and 60 only.
    moved = SharingSchedule(num_layers=8, interval=50, growth=2, target_layers=4, first_switch=10)
    assert [rewarm_factor(i, moved, 1) for i in (9, 10, 11, 60, 61, 110)] == [1, 0.5, 1, 0.5, 1, 1]


def test_the_full_region_at_the_first_step():
    # --epas-first-switch 1 --epas-growth <target>: one switch, before the first step.
    fixed = SharingSchedule(num_layers=8, interval=50, growth=4, target_layers=4, first_switch=1)
    assert [rewarm_factor(i, fixed, 3) for i in (1, 2, 3, 4, 51)] == [0.25, 0.5, 0.75, 1, 1]


@pytest.mark.parametrize("steps, message", [
    (-1, "--epas-switch-rewarm must be an integer >= 0"),
    (4, "--epas-switch-rewarm 4 must be smaller than --epas-interval 4"),
    (1.5, "--epas-switch-rewarm must be an integer >= 0"),
])
def test_refused_values(steps, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SwitchRewarm(TINY, steps)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        rewarm_factor(5, TINY, steps)


def test_describe_state_and_resume_checks():
    rewarm = SwitchRewarm(TINY, 2)
    assert rewarm.enabled and not SwitchRewarm(TINY, 0).enabled
    assert "x (k+1)/3 at iteration t+k, k = 0..1" in rewarm.describe() and "iterations 4-5, 8-9" in rewarm.describe()
    assert "no FLOPs change" in rewarm.describe()
    assert rewarm.state_dict() == {"steps": 2}
    rewarm.check_resume({"steps": 2}, 5)
    with pytest.raises(ConfigError, match="trained with --epas-switch-rewarm 1, this run has --epas-switch-rewarm 2"):
        rewarm.check_resume({"steps": 1}, 5)
    with pytest.raises(ConfigError, match="trained with --epas-switch-rewarm 0, this run"):
        rewarm.check_resume(None, 5)
