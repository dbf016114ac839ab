"""Activation memory of Transformer Engine layers against the memory model (skipped where TE does
not import; issue #42 item 3). Written 2026-11-28, **not yet run on a GPU**.

:mod:`epas_megatron.metrics.memory_model` counts what the *local* layers keep (its scope note: TE
fuses more and keeps less), yet ``epas-plan`` and the trainer's memory figures use it for TE runs
too, with TE's kernels (``assembly.memory_kernels``: torch's one-kernel RMSNorm term for TE's fused
norm, Megatron's fused SwiGLU, TE's fused RoPE). Measured here, bf16, one micro-batch, PP=1, the
shape of test_gpu_memory_and_nccl.py (h 1024, 16/4 heads, F 2816, s 1024, b 2), regions 0 and 2:

* what a forward keeps for backward (``torch.cuda.memory_allocated`` after the forward less
  before it, after a warm-up step has taken TE's and cuBLAS's workspaces and cuDNN's plans) is no
  more than the model's layers, LM head and embedding (3% for the allocator's rounding): a plan
  made with the model never under-budgets a TE run;
* sharing layers keep less with TE too: each sharing layer's saved tensors (saved-tensor hooks,
  storage by storage) are at least its Q's bytes (``s·b·a·d``, the least a layer with no Q/K
  projection drops) under every computing layer's. Control: the same criterion applied to the
  same layers of the region-0 model fails.

The measured figures are printed per layer beside the model's tensors, for the ledger and for TE
terms in the model should they differ.
"""

import gc

import pytest
import torch

from epas_megatron.model.fusions import transformer_engine_importable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not transformer_engine_importable(),
                       reason="Transformer Engine is not installed on this node (pip install -r requirements-gpu.txt)"),
]

ROUNDING = 0.03
"""The allocator's share of a figure (its 512-byte blocks, small tensors), as in
test_gpu_memory_and_nccl.py."""


def _setup(sharing):
    """A bf16 TE model of the GPU memory test's shape with Megatron's DDP and mixed-precision
    optimizer, the memory model's shape and settings for it (``memory_kernels`` of the TE backend)."""
    from epas_megatron.assembly import memory_kernels
    from epas_megatron.engine.optimizer import OptimizerSettings
    from epas_megatron.engine.state import build_training_state
    from epas_megatron.metrics.rank_memory import RankMemorySettings
    from epas_megatron.model.architecture import LlamaArchitecture, ModelShape
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.fusions import KernelAvailability

    arch = LlamaArchitecture(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                             ffn_hidden_size=2816, vocab_size=8192, max_sequence_length=1024)
    s, b = 1024, 2
    plan = BuildPlan.for_region(arch, sharing, seq_length=s, precision="bf16", backend="transformer_engine")
    optimizer = OptimizerSettings(lr=1e-4, min_lr=1e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                  clip_grad=1.0, use_distributed_optimizer=False, overlap_grad_reduce=False,
                                  warmup_iters=1, decay_iters=10, decay_style="cosine", precision="bf16")
    state = build_training_state(plan, optimizer, seed=1)
    shape = ModelShape(arch, s, b)
    settings = RankMemorySettings(precision="bf16",
                                  **memory_kernels(KernelAvailability.detect(), plan.backend))
    return arch, state, shape, settings


def _batch(arch, s, b):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (b, s + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s), "sample_ids": torch.arange(b)}


def _measure(sharing) -> dict:
    """Kept for backward (allocator), the model's figure, and saved bytes per layer (hooks)."""
    from epas_megatron.engine.step import train_step
    from epas_megatron.metrics.activation_memory import measure_saved_bytes
    from epas_megatron.metrics.memory_model import layer_activation_bytes, layer_activation_tensors
    from epas_megatron.metrics.rank_memory import embedding_activation_bytes, head_activation_bytes
    from epas_megatron.runtime.device import to_compute_device

    gc.collect()
    arch, state, shape, settings = _setup(sharing)
    roles = ["share" if i in sharing else "compute" for i in range(arch.num_layers)]
    s, b = shape.seq_length, shape.micro_batch_size
    batch = _batch(arch, s, b)
    # A warm-up step: TE's and cuBLAS's workspaces, cuDNN's attention plans, the rotary table and
    # Adam's state are allocated before the measurement, not in it.
    train_step(state.model, state.optimizer, state.scheduler, [iter([dict(batch)])], num_microbatches=1,
               seq_length=state.schedule_seq_length, micro_batch_size=b)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    inputs = to_compute_device({k: v for k, v in batch.items() if k != "sample_ids"})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = state.model[0](inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"])
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del loss
    saved = measure_saved_bytes(state.model[0], inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"])
    kernels = settings.kernels
    modelled = (sum(layer_activation_bytes(shape, role, "qk", 2, **kernels) for role in roles)
                + head_activation_bytes(shape, 2, fused_norm=settings.fused_norm)
                + embedding_activation_bytes(shape))
    result = {"kept": kept, "modelled": modelled, "layers": dict(saved.layers), "tensors": dict(saved.tensors),
              "model_tensors": {i: layer_activation_tensors(shape, role, "qk", 2, **kernels) for i, role in enumerate(roles)},
              "q_bytes": s * b * arch.num_attention_heads * shape.head_dim * 2, "kernels": kernels}
    del state
    gc.collect()
    return result


def _sharing_layers_keep_less(measured: dict, sharing) -> bool:
    """Each layer in ``sharing`` saved at least ``q_bytes`` less than every other layer."""
    layers = measured["layers"]
    others = [n for i, n in layers.items() if i not in sharing]
    return all(layers[i] <= min(others) - measured["q_bytes"] for i in sharing)


def test_te_layers_keep_no_more_than_the_memory_model(world):
    """Regions 0 and 2 (layers 2 and 3 sharing), module doc. About 10 s (two builds of a 4-layer
    h 1024 model, a step and three forwards each)."""
    results = {sharing: _measure(sharing) for sharing in ((), (2, 3))}
    for sharing, r in results.items():
        print(f"TE region {len(sharing)} ({r['kernels']}): kept for backward {r['kept'] / 2**20:.2f} MiB, model "
              f"{r['modelled'] / 2**20:.2f} MiB (measured / model {r['kept'] / r['modelled']:.4f})")
        for index, n in sorted(r["layers"].items()):
            print(f"  layer {index}: saved {n / 2**20:.2f} MiB {sorted(r['tensors'][index])}; "
                  f"model {sum(r['model_tensors'][index]) / 2**20:.2f} MiB {sorted(r['model_tensors'][index])}")
    for sharing, r in results.items():
        assert r["kept"] <= (1 + ROUNDING) * r["modelled"], (sharing, r["kept"], r["modelled"])
    assert _sharing_layers_keep_less(results[(2, 3)], (2, 3)), results[(2, 3)]["layers"]
    assert not _sharing_layers_keep_less(results[()], (2, 3)), results[()]["layers"]  # the control
