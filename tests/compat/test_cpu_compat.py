"""The CPU stand-ins for Megatron-Core's CUDA-only calls: active here, scoped, and correct."""

import subprocess
import sys

import pytest
import torch

from epas_megatron.compat import cpu_compat

pytestmark = pytest.mark.cpu_only  # the stand-ins are active only without CUDA


@pytest.fixture(scope="module", autouse=True)
def active():
    assert not torch.cuda.is_available()
    assert cpu_compat.activate() and cpu_compat.activate()  # idempotent
    assert cpu_compat.is_active()


def test_literal_cuda_devices_inside_megatron_become_cpu():
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.triu(torch.ones(4, 4), diagonal=1).bool())


def test_patch_is_scoped_to_megatron_modules():
    # torch itself is untouched: outside the patched modules "cuda" still means CUDA.
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_rng_tracker_forks_the_cpu_generator():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("stream", 5)
    torch.manual_seed(0)
    outside_before = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(3)
    with tracker.fork("stream"):
        second = torch.rand(3)
    reference = torch.Generator().manual_seed(5)
    assert torch.equal(first, torch.rand(3, generator=reference))
    assert torch.equal(second, torch.rand(3, generator=reference))
    assert torch.equal(torch.rand(3), outside_before)  # the default stream was restored


def test_gradient_clipping_scales_cpu_gradients():
    from megatron.core.optimizer import clip_grads

    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    params[0].grad = torch.full((4,), 3.0)
    params[1].grad = torch.full((3,), 4.0)
    total = float(torch.sqrt(torch.tensor(4 * 9.0 + 3 * 16.0)))
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    assert torch.allclose(params[0].grad, torch.full((4,), 3.0 / (total + 1e-6)))
    assert torch.allclose(params[1].grad, torch.full((3,), 4.0 / (total + 1e-6)))


def test_inactive_when_cuda_is_present():
    code = (
        "import torch; torch.cuda.is_available = lambda: True\n"
        "from epas_megatron.compat import cpu_compat\n"
        "original = torch.cuda.current_device\n"
        "assert cpu_compat.activate() is False and not cpu_compat.is_active()\n"
        "assert torch.cuda.current_device is original\n"
        "print('untouched')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "untouched" in out
