"""Mixture-of-Channels on a GPU: what a MoC layer keeps for backward against the CUDA allocator
(the memory model's ``moc_sparse`` term, bf16), and the sparse-read decode step inside a CUDA
graph against the eager dense-masked step.

References: the memory model (checked byte for byte on CPU by tests/metrics), and the engine's
own eager masked decode (checked against full forwards on CPU by tests/inference).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

S, B = 256, 2


def _arch():
    from epas_megatron.model.architecture import LlamaArchitecture

    return LlamaArchitecture(num_layers=4, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=704,
                             vocab_size=512, max_sequence_length=S, init_method_std=0.05)


def _moc():
    from epas_megatron.model.moc_sizes import MoCSettings

    return (MoCSettings(0.2, 8),)  # the build option: Mixture-of-Channels MLPs


def test_moc_layers_keep_the_models_bytes_on_the_gpu(world):
    """Per layer, the storages autograd keeps on the GPU (saved-tensor hooks on CUDA tensors, bf16
    with the GPU's kernels) equal the memory model's, with the sparse MLP term."""
    from epas_megatron.assembly import memory_kernels
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.metrics.memory_model import layer_activation_tensors
    from epas_megatron.model.architecture import ModelShape
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model
    from epas_megatron.model.fusions import KernelAvailability
    from epas_megatron.model.moc_sizes import MoCSettings

    arch = _arch()
    plan = BuildPlan.for_region(arch, (2, 3), seq_length=S, precision="bf16", options=_moc())
    model = build_model(plan, seed=1).chunks[0]
    tokens = torch.randint(0, arch.vocab_size, (B, S), device="cuda")
    saved = measure_saved_bytes(model, tokens, torch.arange(S, device="cuda").expand(B, S), None, labels=tokens)
    shape = ModelShape(arch, S, B)
    kernels = memory_kernels(KernelAvailability.detect())
    for index in range(arch.num_layers):
        role = "share" if index in (2, 3) else "compute"
        model_tensors = layer_activation_tensors(shape, role, "qk", 2, moc=MoCSettings(0.2, 8), **kernels)
        got = sorted(n for n in saved.tensors[index] if n >= 1024)
        print(f"layer {index} ({role}): saved {got}, model {model_tensors}")
        assert sum(got) == pytest.approx(sum(model_tensors), rel=0.02), (index, role)


def test_sparse_decode_in_a_cuda_graph_equals_the_masked_eager_step(world):
    """Decode steps reading only the kept rows of W_down, captured in a CUDA graph, give the
    masked eager engine's logits (bf16 tolerance)."""
    from epas_megatron.inference.decode_step import StaticDecodeStep
    from epas_megatron.inference.engine import DecodeEngine
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import build_model

    plan = BuildPlan.for_region(_arch(), (2, 3), seq_length=64, precision="bf16", options=_moc())
    model = build_model(plan, seed=2).chunks[0].eval()
    prompt = torch.randint(0, 512, (2, 16), device="cuda")
    fed = torch.randint(0, 512, (2, 8), device="cuda")
    outputs = {}
    for mode, graph in (("masked", False), ("sparse", True)):
        engine = DecodeEngine(model, moc_decode=mode)
        cache = engine.new_cache(2, 64)
        logits = [engine.forward(prompt, cache)[:, -1].float()]
        step = StaticDecodeStep(engine, cache, graph=graph)
        assert step.captured == graph, "the CUDA graph capture fell back"
        for k in range(fed.shape[1]):
            logits.append(step(fed[:, k:k + 1])[:, -1].float().clone())
        outputs[mode] = torch.stack(logits, 1)
    torch.testing.assert_close(outputs["sparse"], outputs["masked"], rtol=5e-2, atol=5e-2)
