"""Device placement is checked on CPU: with ``meta`` standing in for the GPU, every path that
feeds a model (the trainer's data, Megatron's schedules, evaluation, the benchmarks' synthetic
inputs, a pipeline stage's received tensor) keeps its tensors on the model's device -- and a CPU
batch fed straight to the model fails the way it fails on a GPU."""

import subprocess
import sys

import pytest

from epas_testing import REPO, json_lines, run_script

SCRIPT = REPO / "tests" / "compat" / "scripts" / "device_guard_check.py"


@pytest.mark.cpu_only  # the guard stands in for a GPU; device_guard.activate() refuses where there is one
def test_trainer_schedule_and_evaluation_keep_batches_on_the_model_device():
    proc = subprocess.run([sys.executable, str(SCRIPT), "trainer"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result,) = json_lines(proc.stdout, "GUARD")
    assert result["parameter_devices"] == ["meta"]
    assert result["negative_control"].startswith("DevicePlacementError: embedding got CPU tensor")
    assert result["train_schedule"] == "ok"
    assert result["eval_schedule"] == "ok"


@pytest.mark.distributed
@pytest.mark.cpu_only
def test_pipeline_stages_and_benchmark_inputs_keep_tensors_on_the_model_device():
    proc = run_script(SCRIPT, ["pipeline"], nproc=2, timeout=600)
    results = sorted(json_lines(proc.stdout, "GUARD"), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert result["forward_step_stage"] == "ok", result
        assert result["bench_stage_compute"] == "ok", result


def test_mixed_device_check_follows_cuda_rules():
    """In-process unit check of the rule itself (no stand-in activation needed)."""
    import torch

    from epas_megatron.compat.device_guard import DevicePlacementError, MixedDeviceCheck

    weight = torch.empty(8, 4, device="meta")
    with MixedDeviceCheck():
        torch.nn.functional.embedding(torch.zeros(3, dtype=torch.long, device="meta"), weight)  # same device
        weight * torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar, as on CUDA
        torch.empty(8, 4, device="meta").copy_(torch.ones(8, 4))  # cross-device copies are legal, as on CUDA
        with pytest.raises(DevicePlacementError, match="embedding"):
            torch.nn.functional.embedding(torch.zeros(3, dtype=torch.long), weight)  # PyTorch alone lets this pass
        with pytest.raises(DevicePlacementError, match="matmul"):
            torch.matmul(weight, torch.ones(4, 2))
