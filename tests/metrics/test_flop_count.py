"""Independent counts of the FLOPs model: PyTorch's FlopCounterMode over one forward + backward
of the model at several regions, and DeepSpeed's FLOPs profiler over one forward.

What each side counts: the model counts matmuls only (2 FLOPs per multiply-add, 3 x forward,
the full s x s scores under Convention.PAPER); FlopCounterMode counts the aten matmul ops it
has formulas for (mm, bmm, baddbmm, and the CUDA SDPA kernels), forward and backward as they
run. With unfused attention (scores by baddbmm, probs.V by bmm) the two agree exactly, term by
term. With SDPA on CPU the counter has no formula for the CPU flash kernel
(aten._scaled_dot_product_flash_attention_for_cpu) and misses exactly the attention core: the
2 x 2 s^2 h FLOPs per layer and sequence, three times.

DeepSpeed's profiler patches torch functions (matmul, baddbmm, softmax, F.scaled_dot_product_
attention, ...) and counts the forward only. With SDPA it equals the model's forward exactly (its
attention formula counts the full s x s scores, as Convention.PAPER does); with unfused attention
it also counts baddbmm's addend and the softmax, one FLOP per score each: 2 b a s^2 per layer."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from epas_megatron.metrics.flops import Convention, layer_matmul_flops, training_flops_per_sequence
from epas_megatron.model.architecture import ModelShape

pytestmark = pytest.mark.usefixtures("single_process")

S, B = 32, 2


def counted(share, region, core_attention):
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_testing import build

    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, S)
    model = build(arch, tuple(range(4 - region, 4)), share=share, core_attention=core_attention)
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens, torch.arange(S).expand(B, S), None, labels=tokens).sum().backward()
    ops = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), ops, ModelShape(arch, S)


def _core(shape) -> int:
    """Forward FLOPs of the attention core of one layer and sequence (scores and probs.V)."""
    flops = layer_matmul_flops(shape, Convention.PAPER)
    return flops.attention_scores + flops.attention_values


@pytest.mark.parametrize("share", ["qk", "kv"])
@pytest.mark.parametrize("region", [0, 1, 3])
def test_flop_counter_equals_the_model_with_unfused_attention(share, region):
    total, ops, shape = counted(share, region, "unfused")
    assert total == B * training_flops_per_sequence(shape, region, share, Convention.PAPER)
    # Term by term: the attention core is the batched matmuls, everything else the plain ones.
    core = 3 * shape.num_layers * B * _core(shape)
    assert ops.get("aten.bmm", 0) + ops.get("aten.baddbmm", 0) == core
    assert ops["aten.mm"] == total - core


def test_flop_counter_misses_the_cpu_flash_kernel_and_nothing_else():
    total, ops, shape = counted("qk", 2, "sdpa")
    core = 3 * shape.num_layers * B * _core(shape)
    assert set(ops) == {"aten.mm"}
    assert total == B * training_flops_per_sequence(shape, 2, "qk", Convention.PAPER) - core


@pytest.mark.parametrize("core_attention", ["sdpa", "unfused"])
@pytest.mark.parametrize("share,region", [("qk", 0), ("qk", 2), ("kv", 3)])
def test_deepspeed_profiler_counts_the_models_forward(core_attention, share, region):
    pytest.importorskip("deepspeed", reason="optional: tools/setup_env.sh installs it (DS_BUILD_OPS=0)")
    from deepspeed.profiling.flops_profiler import FlopsProfiler

    from epas_megatron.metrics.flops import forward_flops_per_sequence
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_testing import build

    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, S)
    model = build(arch, tuple(range(4 - region, 4)), share=share, core_attention=core_attention)
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.no_grad():
        model(tokens, torch.arange(S).expand(B, S), None, labels=tokens)
    total = profiler.get_total_flops()
    profiler.end_profile()
    expected = B * forward_flops_per_sequence(ModelShape(arch, S), region, share, Convention.PAPER)
    if core_attention == "unfused":  # baddbmm's addend and the softmax: one FLOP per score each
        expected += arch.num_layers * 2 * B * arch.num_attention_heads * S * S
    assert total == expected


@pytest.mark.parametrize("region, kept", [(0, 8), (2, 12), (3, 20)])
def test_flop_counter_equals_the_model_under_random_ltd(region, kept):
    """Random-LTD layers run on their kept tokens: FlopCounterMode (forward + backward, unfused
    attention) equals the layerwise model exactly; the source of a region projects Q/K/V for all."""
    from epas_megatron.metrics.flops import layerwise_forward_flops
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.random_ltd.model import set_kept_tokens
    from epas_megatron.random_ltd.option import RandomLTDSettings

    arch = LlamaArchitecture(4, 64, 4, 2, 176, 512, S)
    sharing = tuple(range(4 - region, 4))
    plan = BuildPlan.for_region(arch, sharing, core_attention="unfused", options=(RandomLTDSettings((0, 1, 2, 3), kernels="torch"),))
    model = build_model(plan, seed=3).chunks[0]
    set_kept_tokens([model], kept)
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens, torch.arange(S).expand(B, S), None, labels=tokens, sample_ids=torch.arange(B)).sum().backward()
    source = 3 - region if region else None
    modes = ["share_qk" if i in sharing else "compute" for i in range(4)]
    qkv = [S if i == source else kept for i in range(4)]
    expected = 3 * B * layerwise_forward_flops(ModelShape(arch, S), modes, [kept] * 4, Convention.PAPER, qkv)
    assert counter.get_total_flops() == expected
    assert expected < 3 * B * layerwise_forward_flops(ModelShape(arch, S), modes, None, Convention.PAPER)
