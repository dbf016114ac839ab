"""An 8-layer model with every sharing region 0..7 under PP=2 (1F1B), PP=2 x VPP=2 and uneven
layouts gives the loss and grad norm of PP=1 within 1e-5 (the QK hand-off crosses stages); so
does a region that ends before the last layer (--epas-exclude-last), whose computing tail sits
behind a stage boundary, and regions of several blocks (--epas-blocks), whose hand-offs cross
different boundaries."""

from pathlib import Path

import pytest

from epas_testing import json_lines, run_script

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    proc = run_script(Path(__file__).parent / "scripts" / "region_layouts.py", nproc=2)
    return {(r["layout"], r["region"], r["exclude_last"], r["blocks"]): r for r in json_lines(proc.stdout, "RESULT")}


REGIONS = [(r, 0, 1) for r in range(8)] + [(3, 2, 1), (4, 0, 2), (6, 0, 2), (4, 0, 4)]


@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2", "uneven_6_2", "uneven_1_7", "uneven_vpp_2_3_1_2"])
def test_every_region_matches_pp1(results, layout):
    for key in REGIONS:
        ref, got = results[("pp1", *key)], results[(layout, *key)]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (layout, key)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (layout, key)


def test_regions_change_the_result_and_cross_stages(results):
    losses = [results[("pp1", *key)]["loss"] for key in REGIONS]
    assert len(set(losses)) == len(REGIONS)  # every region computes something different
    # Regions reaching back past the stage boundary send the hand-off (extra p2p rows).
    assert results[("pp2", 2, 0, 1)]["p2p_rows"] == 32 and results[("pp2", 5, 0, 1)]["p2p_rows"] > 32
    # Layers 3-5 with a computing tail: crossing the even split's boundary (before layer 4) sends
    # the hand-off; a boundary right after the region (before layer 6) does not.
    assert results[("pp2", 3, 2, 1)]["p2p_rows"] > 32 and results[("uneven_6_2", 3, 2, 1)]["p2p_rows"] == 32
    # Two blocks 2-3 and 6-7: the even split's boundary before layer 4 (a computing layer) carries
    # nothing; the boundaries before 2 and 6 do.
    assert results[("pp2", 4, 0, 2)]["p2p_rows"] == 32
    assert results[("uneven_6_2", 4, 0, 2)]["p2p_rows"] > 32 and results[("uneven_vpp_2_3_1_2", 4, 0, 2)]["p2p_rows"] > 32
