"""--eval-regions: parsing, limits and the regions evaluated as the region in training grows."""

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.sharing.regions import RegionSpec
from epas_megatron.sharing.shape import RegionShape


def test_parse_keeps_sizes_and_names_in_order():
    assert RegionSpec.parse("0, half,MAX,3").items == (0, "half", "max", 3)


@pytest.mark.parametrize("text", ["-1", "1.5", "quarter", "", "0,,2"])
def test_parse_rejects_what_is_not_a_region(text):
    with pytest.raises(ConfigError, match="--eval-regions: .* is not a region size"):
        RegionSpec.parse(text)


def test_limit_names_the_flag_and_the_largest_region():
    RegionSpec.parse("0,3,max").check_limit(RegionShape(4))
    with pytest.raises(ConfigError, match="--eval-regions: 4 sharing layers is more than this model can have: at most 3"):
        RegionSpec.parse("0,4").check_limit(RegionShape(4))
    # two blocks of 8 layers: spans 0-3 and 4-7, each keeps its source -> at most 6
    with pytest.raises(ConfigError, match=r"at most 6 \(one layer before each of its --epas-blocks 2 blocks"):
        RegionSpec.parse("7").check_limit(RegionShape(8, blocks=2))


@pytest.mark.parametrize("current, expected, skipped", [
    (0, [0], [2]),          # before the first switch: 'half' and 'max' are 0, 2 is not trained yet
    (1, [0, 1], [2]),
    (2, [0, 1, 2], []),     # half of 2 is 1
    (5, [0, 2, 5], []),     # half of 5 is 2 (rounded down), equal to the explicit 2: listed once
])
def test_resolve_follows_the_region_in_training(current, expected, skipped):
    assert RegionSpec.parse("0,half,max,2").resolve(current) == (expected, skipped)


def test_untrained_regions_on_request():
    assert RegionSpec.parse("0,max,3").resolve(1, allow_untrained=True) == ([0, 1, 3], [])


def test_parse_regions_with_exclude_last():
    from epas_megatron.errors import ConfigError
    from epas_megatron.sharing.regions import parse_regions

    assert parse_regions("0,2,max", 2, RegionShape(8, exclude_last=3), False) == [0, 2, 2]
    assert parse_regions("half,max,0", 3, 8, False) == [1, 3, 0]  # in the order given; half rounds down
    assert parse_regions("4", 2, RegionShape(8, exclude_last=3), True) == [4]
    with pytest.raises(ConfigError, match=r"at most 4 .*--epas-exclude-last 3"):
        parse_regions("5", 2, RegionShape(8, exclude_last=3), True)
    assert parse_regions("7", 2, 8, True) == [7]  # the default: the region may reach layer 1
