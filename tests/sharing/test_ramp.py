"""The blended switch's steps (epas_megatron.sharing.ramp) against values worked out by hand."""

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.ramp import RampStep, SwitchRamp, ramp_step
from epas_megatron.sharing.schedule import SharingSchedule

# 4 layers, 2 targets, one per switch every 4 iterations: switches at 4 (layer 3) and 8 (layer 2).
TINY = SharingSchedule(num_layers=4, interval=4, growth=1, target_layers=2)


def test_the_hand_computed_steps_of_a_tiny_schedule():
    # N = 3: iterations 1-3 ramp into the switch at 4 (layer 3 blends, layer 2 becomes its source),
    # 5-7 into the one at 8 (layer 2 blends -- today's source --, layer 1 becomes the source).
    steps = {i: ramp_step(i, TINY, 3) for i in range(1, 13)}
    assert steps[1] == RampStep(switch=4, weight=1 / 3, blending=(3,), hand_off=(2, 3))
    assert (steps[2].weight, steps[3].weight) == (2 / 3, 1.0)
    assert steps[5] == RampStep(switch=8, weight=1 / 3, blending=(2,), hand_off=(1, 2))
    assert [steps[i].weight for i in (6, 7)] == [2 / 3, 1.0]
    assert [i for i, step in steps.items() if step is None] == [4, 8, 9, 10, 11, 12]  # after the last switch: none
    # N = 1: the one step before each switch, fully on the source.
    assert [ramp_step(i, TINY, 1) for i in (2, 3, 4, 7)] == [None, RampStep(4, 1.0, (3,), (2, 3)), None, RampStep(8, 1.0, (2,), (1, 2))]
    # N = 0 and EPAS off: never.
    off = SharingSchedule(num_layers=4, interval=4, growth=1, target_layers=0)
    assert {ramp_step(i, TINY, 0) for i in range(1, 13)} == {ramp_step(i, off, 3) for i in range(1, 13)} == {None}


def test_several_layers_and_blocks_per_switch():
    # 8 layers, two blocks of 2 (--epas-blocks 2), 2 layers per switch every 10 iterations: the
    # first switch makes one layer of each block share (the deep end of each half: 3 and 7), their
    # sources 2 and 6; the second extends both blocks (2 and 6 switch, 1 and 5 become sources).
    schedule = SharingSchedule(num_layers=8, interval=10, growth=2, target_layers=4, blocks=2)
    assert schedule.sharing_layers(10) == (3, 7) and schedule.sharing_layers(20) == (2, 3, 6, 7)
    assert ramp_step(8, schedule, 4) == RampStep(10, 3 / 4, (3, 7), (2, 3, 6, 7))
    assert ramp_step(16, schedule, 4) == RampStep(20, 1 / 4, (2, 6), (1, 2, 5, 6))


def test_windows_and_description():
    ramp = SwitchRamp(TINY, 2)
    assert ramp.windows() == [(2, 3), (6, 7)] and ramp.enabled
    assert "--epas-switch-ramp 2" in ramp.describe() and "iterations 2-3, 6-7" in ramp.describe()
    assert not SwitchRamp(TINY, 0).enabled and SwitchRamp(TINY, 0).windows() == []


@pytest.mark.parametrize("steps, message", [
    (-1, "--epas-switch-ramp must be an integer >= 0"),
    (True, "--epas-switch-ramp must be an integer >= 0"),
    (4, "--epas-switch-ramp 4 must be smaller than --epas-interval 4"),
])
def test_refusals(steps, message):
    with pytest.raises(ConfigError, match=message):
        SwitchRamp(TINY, steps)


def test_the_first_switch_must_leave_room_for_its_ramp():
    early = SharingSchedule(num_layers=4, interval=4, growth=1, target_layers=2, first_switch=2)
    SwitchRamp(early, 1)
    with pytest.raises(ConfigError, match="--epas-switch-ramp 2 needs the first switch after iteration 2.*--epas-first-switch is 2"):
        SwitchRamp(early, 2)
    with pytest.raises(ValueError, match="iteration must be an integer >= 1"):
        ramp_step(0, TINY, 2)


def test_resume_with_another_value_is_refused():
    ramp = SwitchRamp(TINY, 2)
    ramp.check_resume({"steps": 2}, 5)
    for saved, named in (({"steps": 3}, "--epas-switch-ramp 3, this run has --epas-switch-ramp 2"),
                         (None, "--epas-switch-ramp 0, this run has --epas-switch-ramp 2")):
        with pytest.raises(ConfigError, match=named):
            ramp.check_resume(saved, 5)
