"""LayerTimer hooks record forward time per layer kind in a real model."""

import pytest

from epas_testing import build
from epas_megatron.model.builder import LlamaArchitecture
from epas_megatron.parallel.cost_model import LayerCosts
from epas_megatron.parallel.layer_timing import LayerTimer, calibrated_costs


@pytest.fixture(scope="module")
def single_process():
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    yield init_distributed(1, 1, None, seed=0)
    destroy_distributed()


def test_timer_counts_each_layer_kind(single_process):
    import torch

    model = build(LlamaArchitecture(4, 64, 4, 2, 176, 256, 32), (2, 3))
    timer = LayerTimer()
    timer.attach([model])
    tokens = torch.randint(0, 256, (1, 32))
    for _ in range(3):
        model(tokens, torch.arange(32).unsqueeze(0), None, labels=tokens)
    assert timer.counts == {"compute": 6, "share": 6, "output_layer": 3}
    timer.detach()
    model(tokens, torch.arange(32).unsqueeze(0), None, labels=tokens)
    assert timer.counts["compute"] == 6  # detached: no more records
    measured = timer.measured()
    assert set(measured) == {"compute", "share", "output_layer"} and all(v > 0 for v in measured.values())
    costs = calibrated_costs(LayerCosts(10.0, 8.0, 0.0, 5.0), timer)
    assert costs.compute_layer == pytest.approx(measured["compute"]) and costs.share_layer == pytest.approx(measured["share"])
