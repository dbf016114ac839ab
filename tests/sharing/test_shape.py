"""RegionShape: regions, switching order, modes and limits of a shape, worked out by hand from
the placement rule (sharing/schedule.py's docstring), and the shape every holder reports."""

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.schedule import SharingSchedule
from epas_megatron.sharing.shape import RegionShape, as_shape


def test_two_blocks_by_hand():
    # 8 layers, 2 blocks: spans 0-3 and 4-7; a region of 4 fills the deep end of each span
    shape = RegionShape(8, blocks=2)
    assert shape.end == 7 and shape.largest == 6  # each span keeps one source: 2 * (4 - 1)
    assert shape.layers(4) == (2, 3, 6, 7)
    assert shape.order(4) == (7, 3, 6, 2)  # deepest block first, each block deep -> shallow
    assert [str(m) for m in shape.modes((2, 3, 6, 7))] == [
        "compute", "source", "share", "share", "compute", "source", "share", "share"]


def test_exclude_last_by_hand():
    shape = RegionShape(8, exclude_last=1)
    assert shape.end == 6 and shape.largest == 6
    assert shape.layers(2) == (5, 6) and shape.order(2) == (6, 5)
    assert [str(m) for m in shape.modes((5, 6))][3:] == ["compute", "source", "share", "share", "compute"]
    with pytest.raises(ConfigError, match="--epas-exclude-last"):
        shape.modes((6, 7))  # the region must end at layer 6


@pytest.mark.parametrize("args, flag", [((0,), "--num-layers"), ((8, 8), "--epas-exclude-last"),
                                        ((8, 0, 0), "--epas-blocks")])
def test_an_impossible_shape_names_its_flag(args, flag):
    with pytest.raises(ConfigError, match=flag):
        RegionShape(*args)


def test_a_layer_count_is_the_papers_shape():
    assert as_shape(6) == RegionShape(6, 0, 1) and as_shape(RegionShape(6, 1)) == RegionShape(6, 1)
    assert as_shape(6).layers(2) == (4, 5)


def test_the_shape_of_a_schedule():
    schedule = SharingSchedule.from_flags(8, 10, 1, 4, exclude_last=0, blocks=2)
    assert RegionShape.of(schedule) == RegionShape(8, 0, 2)
    assert schedule.sharing_layers(schedule.final_iteration) == RegionShape.of(schedule).layers(4)
