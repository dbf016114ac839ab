"""Mixture-of-Channels MLP (model/moc.py): at topk = 1 Megatron-Core's dense MLP bit for bit; below
it, a plain-PyTorch masked SwiGLU (fp64: outputs and every gradient, and autograd's gradcheck);
what it keeps for backward, counted through autograd's saved-tensor hooks, equals the sparse form
exactly; and the configuration refusals."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from epas_megatron.errors import ConfigError
from epas_megatron.model.moc import MoCMLP, _MoCSwiGLUDown
from epas_megatron.model.moc_sizes import check_moc_config, kept_channels, moc_saved_bytes_per_token
from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear

H, FFN = 16, 48
SUBMODULES = MLPSubmodules(linear_fc1=DelayedWgradColumnParallelLinear, linear_fc2=DelayedWgradRowParallelLinear)


def _config(dtype=torch.float64):
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, gated_linear_unit=True,
                             activation_func=F.silu, add_bias_linear=False, params_dtype=dtype, use_cpu_initialization=True,
                             bias_activation_fusion=False)


def _pair(topk, groups=4, dtype=torch.float64):
    """A dense MLP and a MoC MLP with the same weights."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_group()
    torch.manual_seed(0)
    dense = MLP(config=_config(dtype), submodules=SUBMODULES, tp_group=tp)
    moc = MoCMLP(config=_config(dtype), submodules=SUBMODULES, topk=topk, groups=groups, tp_group=tp)
    moc.load_state_dict(dense.state_dict())
    return dense, moc


def _grads(mlp, x, grad_out):
    x = x.detach().clone().requires_grad_()
    out = mlp(x)[0]
    out.backward(grad_out)
    return out.detach(), x.grad, mlp.linear_fc1.weight.grad, mlp.linear_fc2.weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeping_every_channel_is_megatrons_mlp_bit_for_bit(single_process, dtype):
    dense, moc = _pair(1.0, dtype=dtype)
    assert moc.kept == FFN // 4
    x = torch.randn(5, 3, H, dtype=dtype)
    grad_out = torch.randn(5, 3, H, dtype=dtype)
    for ours, megatron in zip(_grads(moc, x, grad_out), _grads(dense, x, grad_out)):
        assert torch.equal(ours, megatron)


def _masked_reference(x, w1, w2, groups, k):
    """Plain PyTorch: G, U from fc1; the mask from a descending sort of G within each group (a
    constant); Z = SiLU(G) * U * M; D = Z W2^T."""
    gate, up = torch.chunk(x @ w1.t(), 2, dim=-1)
    s, b, f = gate.shape
    order = gate.detach().reshape(s, b, groups, f // groups).sort(dim=-1, descending=True).indices[..., :k]
    mask = torch.zeros(s, b, groups, f // groups, dtype=gate.dtype).scatter_(-1, order, 1.0).reshape(s, b, f)
    return (F.silu(gate) * up * mask) @ w2.t()


@pytest.mark.parametrize("topk, groups", [(0.25, 4), (0.5, 2), (1 / 12, 4)])
def test_sparse_channels_equal_a_masked_swiglu(single_process, topk, groups):
    _, moc = _pair(topk, groups)
    k = kept_channels(FFN, groups, topk)
    x = torch.randn(6, 2, H, dtype=torch.float64)
    grad_out = torch.randn(6, 2, H, dtype=torch.float64)
    out, grad_x, grad_w1, grad_w2 = _grads(moc, x, grad_out)
    w1 = moc.linear_fc1.weight.detach().clone().requires_grad_()
    w2 = moc.linear_fc2.weight.detach().clone().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = _masked_reference(xr, w1, w2, groups, k)
    ref.backward(grad_out)
    for ours, want in ((out, ref.detach()), (grad_x, xr.grad), (grad_w1, w1.grad), (grad_w2, w2.grad)):
        torch.testing.assert_close(ours, want, rtol=1e-12, atol=1e-12)
    # control: channels were dropped, and dropping them changes the output
    dense = _masked_reference(x, moc.linear_fc1.weight.detach(), moc.linear_fc2.weight.detach(), 1, FFN)
    assert k < FFN // groups and not torch.allclose(out, dense)


def test_gradcheck_of_the_sparse_function():
    torch.manual_seed(3)
    fc1_out = torch.randn(3, 2, 2 * 12, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _MoCSwiGLUDown.apply(a, w, 3, 2), (fc1_out, weight))


def _saved_bytes(module, x) -> int:
    """Bytes of the distinct storages autograd saves in ``module``'s forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen, kept = {}, []

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.requires_grad_())
    return sum(seen.values())


@pytest.mark.parametrize("dtype, value_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_what_a_moc_mlp_keeps_for_backward(single_process, dtype, value_bytes):
    """fc1's input (h per token, as the dense MLP) plus the sparse form. The dense MLP keeps, per
    token, fc1's input (h), its output (2f: G and U), SiLU(G), U + offset and fc2's input Z (f
    each). At the paper's K (20%) MoC keeps at most 0.35x of that."""
    s, b = 8, 2
    dense, moc = _pair(0.2, groups=4, dtype=dtype)
    x = torch.randn(s, b, H, dtype=dtype)
    tokens = s * b
    assert _saved_bytes(moc, x.clone()) == tokens * (H * value_bytes + moc_saved_bytes_per_token(FFN, 4, 0.2, value_bytes))
    assert _saved_bytes(dense, x.clone()) == tokens * (H + 2 * FFN + 3 * FFN) * value_bytes
    for h, f in ((H, FFN), (4096, 11008)):  # this toy width and 7B's
        assert h * value_bytes + moc_saved_bytes_per_token(f, 4, 0.2, value_bytes) <= 0.35 * (h + 5 * f) * value_bytes


@pytest.mark.parametrize("args, match", [
    ((0.0, 8, 64, 1, "local"), "--moc-topk must be in"),
    ((1.5, 8, 64, 1, "local"), "--moc-topk must be in"),
    ((0.2, 7, 64, 1, "local"), "--moc-groups 7 must divide --ffn-hidden-size 64"),
    ((0.2, 2, 64, 4, "local"), "multiple of --tp 4"),
    ((0.2, 8, 64, 1, "transformer_engine"), "--transformer-impl local"),
])
def test_refusals(args, match):
    with pytest.raises(ConfigError, match=match):
        check_moc_config(*args)
    check_moc_config(1.0, 7, 64, 4, "transformer_engine")  # dense: nothing to check
