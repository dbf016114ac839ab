"""An 8-layer model with every sharing region 0..7 under PP=2 (1F1B), PP=2 x VPP=2 and uneven
layouts gives the loss and grad norm of PP=1 within 1e-5 (the QK hand-off crosses stages)."""

from pathlib import Path

import pytest

from epas_testing import json_lines, run_script

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results():
    proc = run_script(Path(__file__).parent / "scripts" / "region_layouts.py", nproc=2)
    return {(r["layout"], r["region"]): r for r in json_lines(proc.stdout, "RESULT")}


@pytest.mark.parametrize("layout", ["pp2", "pp2_vpp2", "uneven_6_2", "uneven_1_7", "uneven_vpp_2_3_1_2"])
def test_every_region_matches_pp1(results, layout):
    for region in range(8):
        ref, got = results[("pp1", region)], results[(layout, region)]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (layout, region)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), (layout, region)


def test_regions_change_the_result_and_cross_stages(results):
    losses = [results[("pp1", r)]["loss"] for r in range(8)]
    assert len(set(losses)) == 8  # every region computes something different
    # Regions reaching back past the stage boundary send the hand-off (extra p2p rows).
    assert results[("pp2", 2)]["p2p_rows"] == 32 and results[("pp2", 5)]["p2p_rows"] > 32
