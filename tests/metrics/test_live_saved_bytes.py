"""The live saved-for-backward tracker (metrics/activation_memory.LiveSavedBytes) on graphs whose
saved tensors are counted by hand: what each autograd op saves (torch's derivative formulas),
storages counted once, parameters skipped, released when autograd releases them (after the node's
backward, or when the graph is dropped), and what a deferred weight-gradient GEMM holds from its
B to its W (model/weight_grad.py)."""

import pytest
import torch

from epas_megatron.metrics.activation_memory import LiveSavedBytes
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE, _LinearWithDelayedWgrad


def test_saved_storages_once_parameters_skipped_released_by_backward():
    x = torch.randn(1000, requires_grad=True)  # 4000 bytes
    w = torch.nn.Parameter(torch.randn(1000))
    tracker = LiveSavedBytes([w])
    with tracker.tracking():
        y = x * w  # saves x (4000) and w (a parameter: skipped)
        assert tracker.current == 4000
        z = y.exp()  # saves its result (4000)
        u = z * z  # saves z twice: one storage, counted once
        v = x.view(10, 100)[:, :5].sin()  # saves a view of x: x's storage, already held
        assert tracker.current == 8000
        (u.sum() + v.sum()).backward()  # sums save nothing
    assert tracker.current == 0 and tracker.peak == 8000
    x_, w_ = x.detach(), w.detach()
    assert torch.allclose(x.grad, 2 * torch.exp(2 * x_ * w_) * w_ + _sin_grad(x_), rtol=1e-5)


def _sin_grad(x):
    grad = torch.zeros(1000)
    grad.view(10, 100)[:, :5] = torch.cos(x.view(10, 100)[:, :5])
    return grad


def test_a_view_counts_its_whole_storage_and_a_dropped_graph_releases():
    big = torch.randn(100, 10, requires_grad=True)  # 4000 bytes
    other = torch.randn(500, requires_grad=True)  # 2000 bytes
    tracker = LiveSavedBytes()
    with tracker.tracking():
        first = (big[:, :1] * 3).sin().sum()  # sin saves its input: a fresh 100-float tensor (400)
        second = (big[:, :2] * other[:200].view(100, 2)).sum()  # mul saves both views: 4000 + 2000
        assert tracker.current == 400 + 4000 + 2000
        first.backward()
        assert tracker.current == 6000
        del second  # the graph goes without a backward: its saved tensors with it
    assert tracker.current == 0 and tracker.peak == 6400


def test_a_deferred_weight_gradient_holds_the_input_and_the_output_gradient_until_w():
    """A delayed-wgrad linear (s 4, b 2, 8 -> 16): its forward saves the input (4·2·8·4 = 256
    bytes; the weight is a parameter); ``(out * out).sum()`` saves ``out`` (512). In B the
    square's node releases ``out`` and the linear defers its GEMM, which holds the input and the
    output gradient ``2·out`` (512): 768 live after B, as after the forward; W runs the GEMM (the
    weight's gradient is ``grad_out^T @ input``) and releases them."""
    inputs = torch.randn(4, 2, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(16, 8))
    tracker = LiveSavedBytes([weight])
    with tracker.tracking(), WEIGHT_GRAD_STORE.arming():
        out = _LinearWithDelayedWgrad.apply(inputs, weight, None, False, False, None)
        loss = (out * out).sum()
        assert tracker.current == 256 + 512
        with WEIGHT_GRAD_STORE.collecting("pass"):
            loss.backward()
        assert tracker.current == 256 + 512 and WEIGHT_GRAD_STORE.pending("pass") == 1 and weight.grad is None
        WEIGHT_GRAD_STORE.run("pass")
        assert tracker.current == 0
    assert tracker.peak == 768
    expected = (2 * out.detach()).reshape(8, 16).t() @ inputs.detach().reshape(8, 8)
    assert torch.allclose(weight.grad, expected, rtol=1e-5)
    assert torch.allclose(inputs.grad, (2 * out.detach()) @ weight.detach(), rtol=1e-5)


def test_one_tracker_follows_the_store_at_a_time():
    with LiveSavedBytes().tracking():
        with pytest.raises(RuntimeError, match="another tracker"):
            with LiveSavedBytes().tracking():
                pass
    assert WEIGHT_GRAD_STORE.on_put is None


S, B = 48, 2


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("share, moc", [("qk", None), ("kv", None), ("qk", MoCSettings(0.25, 4))], ids=["qk", "kv", "qk-moc"])
@pytest.mark.parametrize("precision,element_bytes", [("fp32", 4), ("bf16", 2)])
def test_what_a_split_backward_keeps_until_w_equals_the_models_weight_gradient_terms(share, moc, precision, element_bytes):
    """One process, the whole model (layers 0-1 computing, 2-3 sharing, the LM head), its store
    armed: after the input-gradient backward every saved tensor is released except what the
    deferred GEMMs hold -- byte for byte the memory model's weight_grad_bytes per layer role plus
    head_weight_grad_bytes (the embedding's gradient is not deferred). With Mixture-of-Channels
    MLPs, fc2's deferred GEMM holds the sparse form (indices, k-wide G and U), not Z."""
    from epas_megatron.metrics.memory_model import weight_grad_bytes
    from epas_megatron.metrics.rank_memory import head_weight_grad_bytes
    from epas_megatron.model.architecture import LlamaArchitecture, ModelShape
    from epas_testing import build

    arch = LlamaArchitecture(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=352,
                             vocab_size=512, max_sequence_length=S)
    shape = ModelShape(arch, S, B)
    model = build(arch, (2, 3), share=share, precision=precision, options=(moc,) if moc else ())
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    tracker = LiveSavedBytes(model.parameters())
    with tracker.tracking(), WEIGHT_GRAD_STORE.arming():
        loss = model(tokens, torch.arange(S).expand(B, S), None, labels=tokens)
        forward = tracker.current
        with WEIGHT_GRAD_STORE.collecting("pass"):
            loss.float().sum().backward()
        held = tracker.current
        assert WEIGHT_GRAD_STORE.run("pass") == 2 * 4 + 2 * 4 + 1  # QKV (or own V/Q), proj, fc1, fc2 per layer; the head
        assert tracker.current == 0
    expected = sum(weight_grad_bytes(shape, role, share, element_bytes, moc=moc) for role in ("compute", "compute", "share", "share"))
    assert held == expected + head_weight_grad_bytes(shape, element_bytes)
    if moc is None:  # (MoC's forward keeps so little that its dense fc1 output gradient, held to W, is more)
        assert held < 0.75 * forward
