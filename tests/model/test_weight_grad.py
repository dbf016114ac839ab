"""The weight-gradient split of the local linears (model/weight_grad.py) against plain PyTorch
(``torch.nn.functional.linear`` under autograd, fp64): the input gradient at ``B``, the weight
and bias gradients only after ``W``, into ``.grad`` or Megatron DDP's ``main_grad``; and the store's
guards. Tensor and sequence parallelism and the schedules are tested where they run:
tests/training/test_v_placement.py and tests/distributed/test_parallel_equivalence.py."""

import pytest
import torch

from megatron.core.transformer.transformer_config import TransformerConfig

from epas_megatron.model.weight_grad import (
    WEIGHT_GRAD_STORE,
    DelayedWgradColumnParallelLinear,
    DelayedWgradRowParallelLinear,
    WeightGradStore,
)


def _linear(kind, bias):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=torch.float64,
                               use_cpu_initialization=True, perform_initialization=True)
    init = torch.nn.init.normal_
    if kind == "column":
        return DelayedWgradColumnParallelLinear(8, 6, config=config, init_method=init, bias=bias, gather_output=False)
    return DelayedWgradRowParallelLinear(8, 6, config=config, init_method=init, bias=bias, input_is_parallel=True, skip_bias_add=False)


def _reference(layer, x, grad_out):
    """Plain autograd of ``x @ W^T + b`` on copies of the layer's parameters."""
    weight = layer.weight.detach().clone().requires_grad_()
    bias = layer.bias.detach().clone().requires_grad_() if layer.bias is not None else None
    x = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x, weight, bias).backward(grad_out)
    return x.grad, weight.grad, (bias.grad if bias is not None else None)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_deferred_weight_gradients_equal_plain_autograd(single_process, kind, bias, main_grad):
    """A column-parallel linear adds its bias in the node (deferred with the weight); a
    row-parallel one after the reduction, outside the node: its bias gradient comes at B."""
    torch.manual_seed(0)
    layer = _linear(kind, bias)
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)  # [s, b, h]
    grad_out = torch.randn(5, 3, 6, dtype=torch.float64)
    want_x, want_w, want_b = _reference(layer, x, grad_out)
    params = [layer.weight] + ([layer.bias] if bias and kind == "column" else [])  # what W computes
    if main_grad:  # Megatron DDP's buffer; its hook would add .grad there
        for p in params:
            p.main_grad = torch.zeros_like(p)
    with WEIGHT_GRAD_STORE.arming():
        out = layer(x)[0]
        with WEIGHT_GRAD_STORE.collecting("pass"):
            out.backward(grad_out)
        # B done: the input gradient is there, no weight gradient anywhere yet
        torch.testing.assert_close(x.grad, want_x, rtol=0, atol=1e-12)
        assert all(p.grad is None for p in params)
        if main_grad:
            assert all(not p.main_grad.any() for p in params)
        assert WEIGHT_GRAD_STORE.pending("pass") == 1
        assert WEIGHT_GRAD_STORE.run("pass") == 1
    got_w = layer.weight.main_grad if main_grad else layer.weight.grad
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-12)
    if bias:
        got_b = layer.bias.main_grad if main_grad and kind == "column" else layer.bias.grad
        torch.testing.assert_close(got_b, want_b, rtol=0, atol=1e-12)
    if main_grad:
        assert layer.weight.grad is None


def test_outside_a_collecting_pass_the_gradients_come_at_once(single_process):
    """Armed but not collecting (a whole backward), and disarmed (Megatron's own node): both give
    autograd's gradients immediately; a second backward accumulates."""
    torch.manual_seed(1)
    layer = _linear("column", True)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    grad_out = torch.randn(4, 2, 6, dtype=torch.float64)
    _, want_w, want_b = _reference(layer, x, grad_out)
    with WEIGHT_GRAD_STORE.arming():
        layer(x)[0].backward(grad_out)
    torch.testing.assert_close(layer.weight.grad, want_w, rtol=0, atol=1e-12)
    layer(x)[0].backward(grad_out)  # disarmed
    torch.testing.assert_close(layer.weight.grad, 2 * want_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, 2 * want_b, rtol=0, atol=1e-12)


def test_the_store_refuses_to_lose_gradients():
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="never computed"):
        with store.arming():
            with store.collecting("b0"):
                store.put(lambda: None)
    assert not store.armed and store.pending("b0") == 0  # the failed run left nothing behind
    with store.arming():
        with store.collecting("b0"):
            with pytest.raises(RuntimeError, match="already collecting"):
                with store.collecting("b1"):
                    pass
        with pytest.raises(RuntimeError, match="already armed"):
            with store.arming():
                pass
    order = []
    with store.arming():
        for key in ("a", "b"):
            with store.collecting(key):
                store.put(lambda key=key: order.append(key + "1"))
                store.put(lambda key=key: order.append(key + "2"))
        assert store.run("b") == 2 and store.run("a") == 2 and store.run("a") == 0
    assert order == ["b1", "b2", "a1", "a2"] and store.computed == 4
