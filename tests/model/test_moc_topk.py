"""The Mixture-of-Channels Top-K rule (``epas_megatron/hf/moc_topk.py``: per group the ``k`` largest
values, equal values to the lower channel index, ranked) against a plain Python loop that sorts
each group by (-value, index) (``tests/moc_reference.py``): ties planted at the boundary in every
dtype (three channels for two places, -0.0 against +0.0), natural bf16 ties, the extremes of the
integer-key path and the sorting one; the same channels in training's ``[s, b, g, c]``, decode's
``[t, g, c]`` and the export's ``[b, s, g, c]`` layouts, one group alone, and cast to another
dtype. The control: a rule that breaks ties by the higher index keeps other channels.

Then the MLPs on planted-tie inputs (``G`` exact small integers, ties in about half the groups):
``MoCMLP``'s channels -- the indices it saves for backward -- are the reference's and its output is
a plain-PyTorch masked SwiGLU with the reference's mask (fp32, bf16; the control mask gives
another output); the export's ``EpasMoCMLP`` builds the same ``Z`` and output in its own layout;
and TP = 2, with and without sequence parallelism, keeps TP = 1's channels on every rank (one
two-rank launch, ``tests/distributed/scripts/moc_topk_tp2.py``). The sparse decode and the
exported directory are checked on planted ties in ``tests/inference/test_moc_decode.py`` and
``tests/hf_export/test_moc_export.py``."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from epas_megatron.hf.moc_topk import topk_channels
from epas_megatron.model.moc import MoCMLP, kept_channels
from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear
from epas_testing import REPO, run_script
from moc_reference import (
    assert_close_to_reference,
    boundary_ties,
    forward_keeping,
    gate_groups,
    higher_index_channels,
    masked_swiglu,
    planted_inputs,
    planted_kept,
    planted_weights,
    reference_channels,
)

H, FFN, GROUPS, TOPK = 16, 48, 4, 0.25  # 4 groups of 12 channels, 3 kept
C, K = FFN // GROUPS, 3
S, B = 8, 2
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _ties(shape, dtype, seed=0):
    """Small multiples of 1/4 (exact in every dtype): most groups tie at most ranks."""
    return (torch.randint(-6, 7, shape, generator=torch.Generator().manual_seed(seed)) / 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_planted_ties_at_the_boundary_keep_the_lower_channels(dtype):
    group = torch.tensor([0.25, 3.0, -1.0, 1.5, 0.5, -0.25, 0.0, 1.5, 0.75, 1.5, 2.0, -2.0], dtype=dtype)
    # channels 3, 7 and 9 hold 1.5 and only two places are left after channels 1 (3.0) and 10 (2.0)
    assert topk_channels(group, 4).tolist() == [1, 10, 3, 7] == reference_channels(group, 4).tolist()
    assert higher_index_channels(group, 4).tolist() == [1, 10, 9, 7]  # the control: another choice
    # -0.0 and +0.0 are one value: channel 2 (-0.0) before channel 5 (+0.0)
    zeros = torch.tensor([-1.0, -1.0, -0.0, -1.0, -1.0, 0.0, 1.0, -1.0], dtype=dtype)
    assert topk_channels(zeros, 2).tolist() == [6, 2] == reference_channels(zeros, 2).tolist()
    assert topk_channels(zeros, 3).tolist() == [6, 2, 5]
    # every group of a batch, whatever the others hold
    batch = _ties((5, 3, 12), dtype)
    batch[2, 1] = group
    chosen = topk_channels(batch, 4)
    assert chosen[2, 1].tolist() == [1, 10, 3, 7] and torch.equal(chosen, reference_channels(batch, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c, k", [(12, 1), (12, 3), (44, 11), (300, 60), (7, 7)])
def test_tied_groups_equal_the_reference(dtype, c, k):
    values = _ties((6, 5, c), dtype, seed=c + k)
    ours = topk_channels(values, k)
    assert ours.dtype == torch.long and ours.shape == (6, 5, k)
    assert torch.equal(ours, reference_channels(values, k))
    if k < c:  # the test has ties to decide, and the control decides them otherwise
        assert boundary_ties(values, k) > 0.3
        assert not torch.equal(ours, higher_index_channels(values, k))


def test_natural_bf16_ties_equal_the_reference():
    """Gate-like bf16 values (normal): a tie at the boundary in a few percent of the groups."""
    values = torch.randn(64, 8, 4, 44, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert boundary_ties(values, 11) > 0.02
    assert torch.equal(topk_channels(values, 11), reference_channels(values, 11))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("c", [65536, 65537])
def test_the_extremes_of_the_integer_keys(dtype, c):
    """The widest group of the 16-bit int32 keys (65,536 channels) and one more (the sorting path):
    infinities, the largest finite values, subnormals and both zeros, each twice (tied)."""
    info = torch.finfo(dtype)
    extremes = [float("inf"), -float("inf"), info.max, -info.max, info.tiny / 4, -info.tiny / 4, 0.0, -0.0, 1.0, -1.0]
    values = torch.full((c,), -2.0, dtype=dtype)
    spots = torch.randperm(c, generator=torch.Generator().manual_seed(c))[: 2 * len(extremes)]
    values[spots] = torch.tensor(extremes * 2, dtype=dtype)
    reference = reference_channels(values, 21)  # ranked: its prefixes are the smaller k
    for k in (1, 2, 7, 12, 21):
        assert torch.equal(topk_channels(values, k), reference[:k]), k


def test_the_same_channels_in_every_layout_shape_and_dtype():
    """One batch of bf16 gate values in training's [s, b, g, c], decode's [t, g, c] (t = s * b) and
    the export's [b, s, g, c] (strided, as a transpose, and contiguous); each group alone; cast
    exactly to fp32 and fp64 (the wider keys, the sorting path)."""
    s, b, g, c, k = 7, 3, 4, 44, 11
    gate = _ties((s, b, g, c), torch.bfloat16, seed=5)
    training = topk_channels(gate, k)  # [s, b, g, k]
    assert torch.equal(training, reference_channels(gate, k))
    assert torch.equal(topk_channels(gate.reshape(s * b, g, c), k).reshape(s, b, g, k), training)
    hf = gate.transpose(0, 1)  # [b, s, g, c]
    assert torch.equal(topk_channels(hf, k).transpose(0, 1), training)
    assert torch.equal(topk_channels(hf.contiguous(), k).transpose(0, 1), training)
    assert torch.equal(topk_channels(gate.flatten(0, 1)[5:6], k), training.flatten(0, 1)[5:6])
    for token in ((0, 0, 0), (3, 2, 1), (6, 1, 3)):
        assert torch.equal(topk_channels(gate[token], k), training[token])
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(topk_channels(gate.to(dtype), k), training)


def test_a_refused_count():
    with pytest.raises(ValueError, match="keeping 13 of 12 channels"):
        topk_channels(torch.zeros(12), 13)
    with pytest.raises(ValueError, match="keeping 0 of 12 channels"):
        topk_channels(torch.zeros(12), 0)


# ---------------------------------------------------------------- the MLPs on planted ties


def moc_mlp(dtype, fc1, fc2, tp_group):
    """A MoCMLP (H, FFN, 4 groups, topk 0.25) at TP = 1 with the given full weights."""
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=FFN, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, params_dtype=dtype, use_cpu_initialization=True,
                               bias_activation_fusion=False)
    submodules = MLPSubmodules(linear_fc1=DelayedWgradColumnParallelLinear, linear_fc2=DelayedWgradRowParallelLinear)
    mlp = MoCMLP(config=config, submodules=submodules, topk=TOPK, groups=GROUPS, tp_group=tp_group)
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(fc1)
        mlp.linear_fc2.weight.copy_(fc2)
    return mlp


@pytest.fixture(scope="module")
def planted():
    """Full fp64 weights and [S, B, H] inputs (tests/moc_reference.py)."""
    assert kept_channels(FFN, GROUPS, TOPK) == K
    fc1, fc2 = planted_weights(H, FFN, GROUPS, K)
    x = planted_inputs((S, B), H)
    gate = gate_groups(x, fc1, GROUPS)  # [S, B, GROUPS, C], exact integers
    assert boundary_ties(gate, K) > 0.3
    assert reference_channels(gate, K)[0, 0].tolist() == [planted_kept(C, K)] * GROUPS  # e_0: 3 and 7 of 3, 7, 9
    return fc1, fc2, x, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moc_mlp_keeps_the_reference_channels_and_equals_a_masked_swiglu(single_process, planted, dtype):
    from megatron.core import parallel_state

    fc1, fc2, x, gate = planted
    mlp = moc_mlp(dtype, fc1, fc2, parallel_state.get_tensor_model_parallel_group())
    out, kept = forward_keeping(mlp, x.to(dtype))
    assert torch.equal(kept, reference_channels(gate, K))  # ranked, as saved
    weights = (mlp.linear_fc1.weight.detach(), mlp.linear_fc2.weight.detach())  # as rounded to dtype
    reference = masked_swiglu(x, *weights, GROUPS, K)
    assert_close_to_reference(out, reference, dtype)
    control = masked_swiglu(x, *weights, GROUPS, K, rule=higher_index_channels)
    assert (control - reference).abs().max() > 0.2 * reference.abs().max()  # another choice on the ties: another output


def test_the_export_mlp_builds_the_same_z_and_output(single_process, planted):
    """transformers' layout [b, s, h]; the export's EpasMoCMLP on the same weights as MoCMLP."""
    from megatron.core import parallel_state

    from epas_megatron.hf import EpasLlamaConfig, EpasMoCMLP

    fc1, fc2, x, gate = planted
    config = EpasLlamaConfig(hidden_size=H, intermediate_size=FFN, num_attention_heads=2, moc_topk=TOPK, moc_groups=GROUPS)
    export = EpasMoCMLP(config)
    assert export.kept == K
    gate_w, up_w = fc1.float().chunk(2)
    with torch.no_grad():
        export.gate_proj.weight.copy_(gate_w)
        export.up_proj.weight.copy_(up_w)
        export.down_proj.weight.copy_(fc2)
    seen = []
    export.down_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        out = export(x.float().transpose(0, 1)).transpose(0, 1)  # [b, s, h] -> [s, b, h]
    mask = torch.zeros_like(gate).scatter_(-1, reference_channels(gate, K), 1.0).flatten(-2)
    z = F.silu(gate.flatten(-2)) * (x @ up_w.double().t()) * mask  # [s, b, f]
    torch.testing.assert_close(seen[0].transpose(0, 1).double(), z, rtol=1e-5, atol=1e-6)
    training, _ = forward_keeping(moc_mlp(torch.float32, fc1, fc2, parallel_state.get_tensor_model_parallel_group()), x.float())
    assert_close_to_reference(out, training, torch.float32)
    assert_close_to_reference(out, masked_swiglu(x, fc1.float(), fc2.float(), GROUPS, K), torch.float32)
    control = masked_swiglu(x, fc1.float(), fc2.float(), GROUPS, K, rule=higher_index_channels)
    assert (control - out).abs().max() > 0.2 * out.abs().max()


@pytest.mark.distributed
def test_tp2_keeps_the_channels_of_tp1(single_process, planted, tmp_path):
    """One launch: fp32 and bf16, each without and with sequence parallelism; rank r holds groups
    2r and 2r + 1 and must save TP = 1's channel indices of them, ranked; outputs equal TP = 1's."""
    from megatron.core import parallel_state

    fc1, fc2, x, gate = planted
    torch.save({"x": x, "fc1": fc1, "fc2": fc2}, tmp_path / "planted.pt")
    run_script(REPO / "tests" / "distributed" / "scripts" / "moc_topk_tp2.py", [str(tmp_path)], nproc=2, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = reference_channels(gate, K)  # [S, B, GROUPS, K]
    for dtype in (torch.float32, torch.bfloat16):
        one, kept = forward_keeping(moc_mlp(dtype, fc1, fc2, parallel_state.get_tensor_model_parallel_group()), x.to(dtype))
        assert torch.equal(kept, reference)
        for sequence_parallel in (False, True):
            case = f"{dtype}-sp{int(sequence_parallel)}"
            for rank, results in enumerate(ranks):
                assert torch.equal(results[case]["kept"], reference[:, :, 2 * rank: 2 * rank + 2]), (case, rank)
                assert_close_to_reference(results[case]["out"], one, dtype)
