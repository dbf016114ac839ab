"""Random-LTD on CUDA: DeepSpeed's gather/scatter kernels against the PyTorch ops (forward and
gradients), and a bf16 training run with Random-LTD and EPAS switches."""

import pytest
import torch

from epas_testing import TINY, run_trainer

pytestmark = pytest.mark.gpu


def test_deepspeed_kernels_equal_the_torch_ops():
    from epas_megatron.random_ltd.tokens import TorchTokenOps, deepspeed_kernels_load, token_ops

    problem = deepspeed_kernels_load()
    if problem is not None:
        pytest.skip(f"DeepSpeed's Random-LTD kernels do not load here: {problem}")
    ds, pt = token_ops("deepspeed"), TorchTokenOps()
    torch.manual_seed(0)
    index = torch.sort(torch.randperm(64, device="cuda")[:24]).values.expand(4, -1).contiguous()
    results = []
    for ops in (ds, pt):
        hidden = torch.randn(64, 4, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1), requires_grad=True)
        kept = ops.gather(hidden, index)
        out = ops.scatter(hidden, kept * 3.0, index)
        (out * torch.arange(32, device="cuda")).sum().backward()
        results.append((kept.detach(), out.detach(), hidden.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_bf16_training_with_random_ltd_and_switches(tmp_path):
    run = run_trainer([*TINY, "--train-iters", "12", "--global-batch-size", "8", "--micro-batch-size", "4",
                       "--epas-target-layers", "2", "--epas-interval", "4", "--random-ltd", "--random-ltd-layers", "0-3",
                       "--random-ltd-require-steps", "8"], tmp_path / "run")
    assert run.summary["precision"] == "bf16" and run.summary["random_ltd"]["random_ltd_kept_tokens"] == 64
    losses = run.losses
    assert losses[12] < losses[1]
