"""The memory model against the CUDA allocator, and the in-memory switch and asynchronous saves
over NCCL (a one-GPU world; DP=2 with two GPUs).

Memory (bf16, local layers, SDPA on the flash kernel, one micro-batch, PP=1):

- what a forward keeps for backward -- ``torch.cuda.memory_allocated()`` after the forward less
  before it, the loss held -- equals :mod:`epas_megatron.metrics.memory_model`'s layers, LM head
  and embedding within 3% (the CPU suite holds model and saved-tensor hooks equal byte for byte;
  on the GPU the kernels' own choices -- the flash kernel's saved statistics, the allocator's
  512-byte blocks -- are what this checks);
- after an optimizer step, the resident bytes (weights, fp32 gradient buffer, fp32 main weights
  and Adam moments) equal the model's parameter state within 2%;
- the peak of a whole training step (``torch.cuda.max_memory_allocated()``) lies between the
  model's total (less 3%) and 1.5x it: the model counts what is kept, the peak adds what is transient
  (activation gradients of the layer in backward, the logits' gradient, optimizer temporaries).
  The measured ratio is printed for the ledger.
"""

import pytest
import torch

from epas_testing import TINY, run_trainer

pytestmark = pytest.mark.gpu

DETERMINISTIC = ["--deterministic", "--core-attention", "unfused"]
ARGS = [*TINY, "--train-iters", "9", "--global-batch-size", "8", "--micro-batch-size", "4",
        "--epas-target-layers", "2", "--epas-interval", "3", "--seed", "3", "--init-method-std", "0.1",
        "--lr", "3e-3", "--lr-warmup-iters", "3", *DETERMINISTIC]


def _setup(sharing):
    from epas_megatron.metrics.memory_model import LayerShape, RankMemorySettings
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.training.optimizer import OptimizerSettings
    from epas_megatron.training.state import build_training_state

    arch = LlamaArchitecture(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                             ffn_hidden_size=2816, vocab_size=8192, max_sequence_length=1024)
    s, b = 1024, 2
    plan = BuildPlan.for_region(arch, sharing, seq_length=s, precision="bf16")
    optimizer = OptimizerSettings(lr=1e-4, min_lr=1e-5, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                  clip_grad=1.0, use_distributed_optimizer=False, overlap_grad_reduce=False,
                                  warmup_iters=1, decay_iters=10, decay_style="cosine", precision="bf16")
    state = build_training_state(plan, optimizer, seed=1)
    shape = LayerShape(arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size, s, b)
    settings = RankMemorySettings(vocab_size=arch.vocab_size, precision="bf16")
    return arch, plan, state, shape, settings


def _batch(arch, s, b):
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (b, s + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s), "sample_ids": torch.arange(b)}


@pytest.mark.parametrize("sharing", [(), (2, 3)], ids=["region_0", "region_2"])
def test_memory_model_against_the_cuda_allocator(world, sharing):
    from epas_megatron.metrics.memory_model import (
        embedding_activation_bytes,
        head_activation_bytes,
        layer_activation_bytes,
        rank_memory_bytes,
    )
    from epas_megatron.runtime.device import to_compute_device
    from epas_megatron.training.step import train_step

    arch, plan, state, shape, settings = _setup(sharing)
    roles = ["share" if i in sharing else "compute" for i in range(arch.num_layers)]
    s, b = shape.seq_length, shape.micro_batch_size
    batch = _batch(arch, s, b)

    # What one forward keeps for backward.
    inputs = to_compute_device({k: v for k, v in batch.items() if k != "sample_ids"})
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = state.model[0](inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"])
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    modelled = (sum(layer_activation_bytes(shape, role, "qk", 2) for role in roles)
                + head_activation_bytes(shape, arch.vocab_size, 2) + embedding_activation_bytes(shape))
    print(f"region {len(sharing)}: kept for backward {kept / 2**20:.1f} MiB, model {modelled / 2**20:.1f} MiB "
          f"(model / measured {modelled / kept:.4f})")
    assert abs(kept - modelled) <= 0.03 * modelled, (kept, modelled)
    del loss

    # Resident state after a step; then the peak of a whole step.
    def step():
        iterator = iter([dict(batch)])
        return train_step(state.model, state.optimizer, state.scheduler, [iterator], num_microbatches=1,
                          seq_length=state.schedule_seq_length, micro_batch_size=b)

    step()
    for chunk in state.model:
        chunk.zero_grad_buffer()
    torch.cuda.synchronize()
    predicted = rank_memory_bytes(shape, [roles], 0, 1, 1, settings)
    resident = torch.cuda.memory_allocated()
    print(f"region {len(sharing)}: resident after a step {resident / 2**20:.1f} MiB, parameter state model "
          f"{predicted['parameters'] / 2**20:.1f} MiB (model / measured {predicted['parameters'] / resident:.4f})")
    assert abs(resident - predicted["parameters"]) <= 0.02 * predicted["parameters"], (resident, predicted)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    print(f"region {len(sharing)}: peak of a step {peak / 2**20:.1f} MiB, model total {predicted['total'] / 2**20:.1f} MiB "
          f"(measured / model {peak / predicted['total']:.3f})")
    assert 0.97 * predicted["total"] <= peak <= 1.5 * predicted["total"], (peak, predicted)


def test_in_memory_switch_equals_the_checkpoint_switch_over_nccl(tmp_path):
    """bf16, deterministic kernels: the in-memory exchange (CUDA tensors, NCCL collectives of a
    one-GPU world) gives the staging checkpoint's run bit for bit, with either optimizer."""
    for extra in ([], ["--use-distributed-optimizer"]):
        memory = run_trainer([*ARGS, *extra, "--epas-switch-mode", "memory"], tmp_path / f"memory{len(extra)}")
        staged = run_trainer([*ARGS, *extra, "--epas-switch-mode", "checkpoint"], tmp_path / f"staged{len(extra)}")
        assert "CUDA" in memory.stdout.splitlines()[0]
        assert [s["iteration"] for s in memory.switches] == [3, 6]
        assert memory.losses == staged.losses and memory.grad_norms == staged.grad_norms, extra


def test_async_save_resumes_bit_identically_on_the_gpu(tmp_path):
    """--async-save copies the state to host memory and writes it in a forked process while
    training goes on; the resumed run continues the uninterrupted one."""
    whole = run_trainer([*ARGS, "--async-save", "--save-interval", "2", "--keep-last", "0"], tmp_path / "whole")
    assert "saving checkpoint" in whole.stdout and "in the background" in whole.stdout
    resumed = run_trainer([*ARGS, "--load", str(whole.output_dir / "checkpoints" / "iter_0000004")], tmp_path / "resumed")
    assert resumed.losses == {k: v for k, v in whole.losses.items() if k > 4}
    assert resumed.grad_norms == {k: v for k, v in whole.grad_norms.items() if k > 4}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DP=2 over NCCL needs 2 GPUs")
def test_dp2_distributed_optimizer_switch_modes_agree_over_nccl(tmp_path):
    args = [*ARGS, "--use-distributed-optimizer", "--global-batch-size", "8", "--micro-batch-size", "2"]
    memory = run_trainer([*args, "--epas-switch-mode", "memory"], tmp_path / "memory", nproc=2)
    staged = run_trainer([*args, "--epas-switch-mode", "checkpoint"], tmp_path / "staged", nproc=2)
    assert memory.losses == staged.losses and memory.grad_norms == staged.grad_norms
